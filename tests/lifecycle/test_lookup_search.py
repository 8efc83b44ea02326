"""``LookupSearch`` (probe, confirm, step back, scan) gives exactly the full scan's answer, in few rounds.

The full scan (``plan_lookup(...).resolve(...)``) is the reference: ``test_differential_vllm`` checks it
against vLLM's own coordinator. Here the store holds prefixes with holes in the middle (entries evicted on
some ranks or all), stray entries past the prefix, local hits and retry caps.
"""

from __future__ import annotations

import dataclasses

import pytest
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology, plan_lookup
from hybridkv.lifecycle import lookup as lookup_module
from hybridkv.lifecycle.lookup import PAUSE_EVERY, LookupSearch
from hybridkv.testing.lifecycle_fuzz import family_hashes, geometries
from hypothesis import event, given, note
from hypothesis import strategies as st


@st.composite
def _cases(draw: st.DrawFn):  # type: ignore[no-untyped-def]
    geometry = draw(geometries())
    if draw(st.booleans()):  # vLLM's EAGLE lookup (it matches past the candidate, then drops)
        geometry = dataclasses.replace(geometry, eagle=True)
    num_tokens = draw(st.integers(1, 10 * max(geometry.spans) + 3))
    unit = geometry.hash_unit
    num_units = num_tokens // unit
    hashes = family_hashes(3, num_units)
    scheme = KeyScheme(namespace="search", model="m", geometry=geometry)
    ranks = geometry.topology.ranks
    existing: set[str] = set()
    for g in range(geometry.num_groups):
        end = draw(st.integers(0, num_units)) * unit
        hole_rate = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]))
        for boundary in range(unit, num_units * unit + 1, unit):
            keys = [scheme.key(g, r.tp_rank, hashes[boundary // unit - 1]) for r in ranks]
            roll = draw(st.floats(0, 1))
            if boundary > end:
                if roll < 0.1:
                    existing.update(keys)
            elif roll >= hole_rate:
                existing.update(keys)
            else:  # a hole: evicted on every rank, or on some ranks only
                kept = draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
                existing.update(k for k, keep in zip(keys, kept) if keep and not all(kept))
    block = geometry.scheduler_block_size
    local = draw(st.integers(0, max(0, num_tokens - 1) // block)) * block
    max_boundary = draw(st.one_of(st.none(), st.integers(0, num_tokens)))
    return scheme, hashes, num_tokens, local, max_boundary, existing


@given(case=_cases())
def test_search_equals_full_scan(case) -> None:  # type: ignore[no-untyped-def]
    scheme, hashes, num_tokens, local, max_boundary, existing = case
    note(f"geometry={scheme.geometry.describe()} num_tokens={num_tokens} local={local} cap={max_boundary}")
    full = plan_lookup(scheme, hashes, num_tokens, local, max_boundary=max_boundary)
    expected = full.resolve([key in existing for key in full.keys])

    def pause() -> None:  # the lookup thread hands the GIL over here: it must not change the answer
        return None

    search = LookupSearch(scheme, tuple(hashes), num_tokens, local, max_boundary=max_boundary, pause=pause)
    got = search.run(lambda keys: [key in existing for key in keys])
    note(f"full={expected.boundary} search={got.boundary} rounds={search.num_round_trips}")
    assert got.boundary == expected.boundary
    assert got.plan == expected.plan
    if got.plan is not None:
        assert all(key in existing for _, key in got.plan.entries), "a planned entry is absent"
    assert search.num_round_trips <= 4 + 2, f"{search.num_round_trips} round trips"
    event(f"rounds={search.num_round_trips}")


def _k3(num_tokens: int) -> tuple[KeyScheme, list[bytes]]:
    # MLA block 64 sharded by DCP 8 (span 512), replicated Mamba state, hash unit 64.
    geometry = Geometry(
        groups=(GroupSpec.full(64, layout="mla"), GroupSpec.mamba(64)),
        topology=Topology(tp_size=8, dcp_size=8),
        prefix_match_unit=64,
    )
    assert geometry.hash_unit == 64 and geometry.fine_grained
    return KeyScheme(namespace="k3", model="k3", geometry=geometry), family_hashes(1, num_tokens // 64)


def _saved(scheme: KeyScheme, hashes: list[bytes], upto: int, mamba_at: list[int]) -> set[str]:
    geometry = scheme.geometry
    keys = set()
    for r in geometry.topology.ranks:
        for b in range(512, upto + 1, 512):
            keys.add(scheme.key(0, r.tp_rank, hashes[b // 64 - 1]))
        for b in mamba_at:
            keys.add(scheme.key(1, r.tp_rank, hashes[b // 64 - 1]))
    return keys


def test_k3_128k_two_round_trips_and_few_keys() -> None:
    num_tokens = 128 * 1024
    scheme, hashes = _k3(num_tokens)
    # A previous request saved the first 96K tokens, with Mamba states at every 8K chunk end.
    existing = _saved(scheme, hashes, 96 * 1024, list(range(8192, 96 * 1024 + 1, 8192)))
    full = plan_lookup(scheme, hashes, num_tokens + 1, 0)
    search = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0)
    got = search.run(lambda keys: [key in existing for key in keys])
    assert got.boundary == 96 * 1024 == full.resolve([k in existing for k in full.keys]).boundary
    assert search.num_round_trips == 2
    assert search.num_keys * 5 < len(full.keys), (search.num_keys, len(full.keys))


def test_k3_hole_in_the_middle_steps_back_within_four_round_trips() -> None:
    num_tokens = 128 * 1024
    scheme, hashes = _k3(num_tokens)
    existing = _saved(scheme, hashes, 96 * 1024, list(range(8192, 96 * 1024 + 1, 8192)))
    # Block 100 (tokens 50K..51K) evicted on rank 5 only: the longest restorable boundary is 48K.
    existing.discard(scheme.key(0, 5, hashes[101 * 512 // 64 - 1]))
    full = plan_lookup(scheme, hashes, num_tokens + 1, 0)
    expected = full.resolve([k in existing for k in full.keys]).boundary
    search = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0)
    got = search.run(lambda keys: [key in existing for key in keys])
    assert got.boundary == expected == 48 * 1024
    assert search.num_round_trips <= 4


def test_k3_128k_search_work_comes_in_slices() -> None:
    """The CPU work of a 128K search (thousands of keys) is cut into slices of at most PAUSE_EVERY keys
    or boundaries, with ``pause`` between them: the lookup thread hands the GIL to vLLM's scheduler
    thread there (``connector.lookups``). Pausing does not change the answer."""
    num_tokens = 128 * 1024
    scheme, hashes = _k3(num_tokens)
    existing = _saved(scheme, hashes, 96 * 1024, list(range(8192, 96 * 1024 + 1, 8192)))
    num_pauses = 0

    def pause() -> None:
        nonlocal num_pauses
        num_pauses += 1

    search = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0, pause=pause)
    unpaused = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0)
    got = search.run(lambda keys: [key in existing for key in keys])
    assert got == unpaused.run(lambda keys: [key in existing for key in keys])
    assert num_pauses >= search.num_keys // PAUSE_EVERY // scheme.geometry.topology.tp_size, num_pauses


def test_searches_sharing_facts_answer_as_one_alone_does() -> None:
    """Two searches of one request share ``known``; one is fed while the other has undecided entries
    from facts it saw before: the other must decide them again on the new facts, not keep them open."""
    num_tokens = 128 * 1024
    scheme, hashes = _k3(num_tokens)
    existing = _saved(scheme, hashes, 96 * 1024, list(range(8192, 96 * 1024 + 1, 8192)))
    existing.discard(scheme.key(0, 5, hashes[101 * 512 // 64 - 1]))  # a hole: 48K restorable

    def exists(keys: tuple[str, ...]) -> list[bool]:
        return [key in existing for key in keys]

    alone = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0).run(exists)
    known: dict[str, bool] = {}
    first = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0, known=known)
    second = LookupSearch(scheme, tuple(hashes), num_tokens + 1, 0, known=known)
    keys = first.next_keys()
    assert keys is not None
    first.feed(keys, exists(keys))  # probes answered
    # ``second`` lists its confirm round on the probe facts (entries undecided: rank keys unknown) ...
    second_keys = second.next_keys()
    assert second_keys is not None
    # ... then ``first`` confirms, and the facts grow under ``second``
    keys = first.next_keys()
    assert keys is not None
    first.feed(keys, exists(keys))
    second.feed(second_keys, exists(second_keys))
    for search in (first, second):
        while (keys := search.next_keys()) is not None:
            assert keys, "a round with no keys: an entry stayed undecided on facts that decide it"
            search.feed(keys, exists(keys))
        assert search.result == alone
    assert alone.boundary == 48 * 1024


@given(case=_cases(), data=st.data())
def test_facts_changing_under_a_search_never_stop_it(case, data, monkeypatch_module) -> None:  # type: ignore[no-untyped-def]
    """Another writer of the shared facts (a cancelled lookup still running on the lookup thread) may turn
    an entry absent while the search works (here: at every pause, which comes after every step of work):
    the search never raises, and it ends."""
    scheme, hashes, num_tokens, local, max_boundary, existing = case
    known: dict[str, bool] = {}

    every_key = [
        scheme.key(g, rank.tp_rank, block_hash)
        for g in range(scheme.geometry.num_groups)
        for rank in scheme.geometry.topology.ranks
        for block_hash in hashes
    ]

    def another_writer() -> None:
        """Feeds its own answers: a key the search has not asked yet (present or absent), or a key it saw
        present that has been evicted since."""
        if not data.draw(st.booleans(), label="write"):
            return
        unasked = [key for key in every_key if key not in known]
        present = [key for key, fact in known.items() if fact]
        if unasked and data.draw(st.booleans(), label="new fact"):
            known[data.draw(st.sampled_from(unasked), label="key")] = data.draw(st.booleans(), label="fact")
        elif present:
            known[data.draw(st.sampled_from(present), label="evicted")] = False

    search = LookupSearch(
        scheme, tuple(hashes), num_tokens, local, max_boundary=max_boundary, known=known, pause=another_writer
    )
    for _ in range(100):
        keys = search.next_keys()
        if keys is None:
            break
        search.feed(keys, [key in existing for key in keys])
    assert search.result is not None, "the search did not end"


@pytest.fixture(scope="module")
def monkeypatch_module() -> object:
    """A pause after every step of the search's work (``PAUSE_EVERY = 1``) for the module's tests that
    ask for it."""
    saved = lookup_module.PAUSE_EVERY
    lookup_module.PAUSE_EVERY = 1
    yield None
    lookup_module.PAUSE_EVERY = saved
