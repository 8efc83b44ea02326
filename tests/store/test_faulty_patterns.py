"""``faulty+``'s positional faults: gaps, tails, seeded random gaps, runs of failed calls, scoped per group and
rank -- each hits exactly the positions it names, the same ones for the same seed, over a real inner store
(``faulty+memory://NAME``), and a bad value is refused naming its parameter."""

from __future__ import annotations

import math
import uuid
from urllib.parse import parse_qsl

import pytest
from hybridkv.store import Status, StoreError, open_store
from hybridkv.store.faulty import NO_PATTERNS, FaultyBackend, read_fault_patterns
from hybridkv.store.framed import FramedStore
from hybridkv.store.params import Params
from hybridkv.store.url import open_backend

OK, NOT_FOUND, FAILED = Status.OK, Status.NOT_FOUND, Status.TRANSFER_FAILED


def _block_key(group: int, tp_rank: int, dcp_rank: int, index: int) -> str:
    """A block entry's key as ``KeyScheme.key`` writes it."""
    return f"hkv1/fuzz/0123456789ab/g{group}/tp{tp_rank}/dcp{dcp_rank}/{index:04x}"


def _keys(num_keys: int) -> list[str]:
    return [_block_key(0, 0, 0, i) for i in range(num_keys)]


class Chaos:
    """A ``faulty+memory://NAME?QUERY`` store and a plain view of the same inner store (no faults)."""

    def __init__(self, query: str) -> None:
        self.name = f"patterns-{uuid.uuid4().hex[:8]}"
        self.store: FramedStore = open_store(f"faulty+memory://{self.name}?{query}")
        self.plain: FramedStore = open_store(f"memory://{self.name}")

    def fill(self, keys: list[str]) -> None:
        """Store ``keys`` through the plain view (every value: the key's own bytes)."""
        assert self.plain.put(keys, [key.encode() for key in keys]) == [OK] * len(keys)

    def get(self, keys: list[str]) -> list[Status]:
        """``get`` through the chaos view; an ``OK`` destination must hold its own key's bytes, any other
        one must be untouched."""
        destinations = [bytearray(len(key)) for key in keys]
        statuses = self.store.get_into(keys, destinations)
        for key, status, destination in zip(keys, statuses, destinations):
            expected = key.encode() if status is OK else bytes(len(key))
            assert bytes(destination) == expected, f"{key}: {status} left {bytes(destination)!r}"
        return statuses

    def injected(self, what: str) -> int:
        count = self.store.stats().extra[f"injected_{what}"]
        assert isinstance(count, int)
        return count


def _hit(statuses: list[Status]) -> list[int]:
    """The positions that did not answer ``OK``."""
    return [i for i, status in enumerate(statuses) if status is not OK]


# -- gaps --------------------------------------------------------------------------------------------------


def test_exists_gap_answers_not_found_at_exactly_those_positions_of_every_call() -> None:
    chaos = Chaos("exists_gap=0,3")
    keys = _keys(6)
    chaos.fill(keys)
    for _ in range(3):
        statuses = chaos.store.exists(keys)
        assert statuses == [NOT_FOUND, OK, OK, NOT_FOUND, OK, OK], statuses
    # Positions count from each call's own first key; one past its end touches nothing in it.
    assert chaos.store.exists(keys[2:]) == [NOT_FOUND, OK, OK, NOT_FOUND], "positions are per call"
    assert chaos.store.exists(keys[:3]) == [NOT_FOUND, OK, OK]
    assert chaos.plain.exists(keys) == [OK] * 6, "a gap is an answer, never an eviction"
    assert chaos.injected("exists_pattern") == 3 * 2 + 2 + 1


def test_get_gap_fails_those_positions_and_leaves_their_destinations_untouched() -> None:
    chaos = Chaos("get_gap=1,4")
    keys = _keys(5)
    chaos.fill(keys)
    assert _hit(chaos.get(keys)) == [1, 4]
    assert chaos.get(keys) == [OK, FAILED, OK, OK, FAILED]
    assert chaos.store.exists(keys) == [OK] * 5, "a get gap leaves exists alone"


def test_put_gap_stores_nothing_there() -> None:
    chaos = Chaos("put_gap=2")
    keys = _keys(4)
    assert chaos.store.put(keys, [key.encode() for key in keys]) == [OK, OK, FAILED, OK]
    assert chaos.plain.exists(keys) == [OK, OK, NOT_FOUND, OK], "the failed put stored nothing"


# -- tails -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", ["0", "0.1", "0.25", "0.3", "0.5", "0.7", "1"])
@pytest.mark.parametrize("num_keys", [1, 3, 4, 10])
def test_tail_takes_the_last_ceil_of_the_fraction(tail: str, num_keys: int) -> None:
    """``ceil(F * n)`` of the decimal written: 0.1 of 10 keys is 1 key, 0.7 of 10 is 7."""
    chaos = Chaos(f"exists_tail={tail}&get_tail={tail}")
    keys = _keys(num_keys)
    chaos.fill(keys)
    num_tail = math.ceil(round(float(tail) * num_keys, 9))
    expected = list(range(num_keys - num_tail, num_keys))
    exists = chaos.store.exists(keys)
    assert _hit(exists) == expected and {exists[i] for i in expected} <= {NOT_FOUND}, exists
    assert _hit(chaos.get(keys)) == expected


def test_gap_and_tail_add_up() -> None:
    chaos = Chaos("get_gap=0&get_tail=0.25")
    keys = _keys(8)
    chaos.fill(keys)
    assert _hit(chaos.get(keys)) == [0, 6, 7]


# -- seeded random gaps ------------------------------------------------------------------------------------


def _random_gaps(seed: int, *, extra: str = "", num_calls: int = 5) -> list[list[int]]:
    """Per call, the positions ``exists_random_gaps=2`` answered ``NOT_FOUND``."""
    chaos = Chaos(f"exists_random_gaps=2&seed={seed}{extra}")
    keys = _keys(12)
    chaos.fill(keys)
    calls = []
    for _ in range(num_calls):
        statuses = chaos.store.exists(keys)
        calls.append([i for i, status in enumerate(statuses) if status is NOT_FOUND])
    return calls


def test_random_gaps_are_n_distinct_positions_per_call_the_same_for_a_seed() -> None:
    first = _random_gaps(7)
    assert all(len(gaps) == 2 for gaps in first), first
    assert _random_gaps(7) == first, "the same seed must give the same positions"
    assert len({tuple(map(tuple, _random_gaps(seed))) for seed in range(6)}) > 1, "the seed changes nothing"


def test_random_gaps_do_not_shift_with_the_probabilities() -> None:
    """Their generator is their own: ``exists_fail`` draws (answered ``TRANSFER_FAILED``) move nothing."""
    assert _random_gaps(11, extra="&exists_fail=0.5") == _random_gaps(11)


def test_random_gaps_take_a_whole_smaller_call() -> None:
    chaos = Chaos("get_random_gaps=5&seed=1")
    keys = _keys(3)
    chaos.fill(keys)
    assert chaos.get(keys) == [FAILED] * 3


# -- runs of failed calls ------------------------------------------------------------------------------------


def test_fail_after_and_fail_calls_fail_exactly_those_calls_counted_over_fail_ops() -> None:
    chaos = Chaos("fail_after=2&fail_calls=3")
    keys = _keys(3)
    chaos.fill(keys)  # through the plain view: not numbered
    calls = [
        chaos.store.exists(keys),  # 1
        chaos.get(keys),  # 2
        chaos.store.exists(keys),  # 3: fails
        chaos.store.put(keys, [b"x"] * 3),  # 4: fails
        chaos.get(keys),  # 5: fails
        chaos.get(keys),  # 6
    ]
    assert chaos.store.exists([]) == [], "a call without keys is not numbered"
    assert chaos.store.exists(keys) == [OK] * 3  # 7
    assert [_hit(statuses) for statuses in calls] == [[], [], [0, 1, 2], [0, 1, 2], [0, 1, 2], []]
    assert calls[2] == [FAILED] * 3, "a failed exists call fails: it is not a gap"
    assert chaos.injected("failed_calls") == 3


def test_fail_ops_numbers_only_its_operations() -> None:
    chaos = Chaos("fail_after=1&fail_calls=1&fail_ops=get")
    keys = _keys(2)
    chaos.fill(keys)
    assert chaos.store.exists(keys) == [OK, OK], "exists is not numbered"
    assert chaos.get(keys) == [OK, OK]  # get 1
    assert chaos.store.exists(keys) == [OK, OK]
    assert chaos.get(keys) == [FAILED, FAILED]  # get 2
    assert chaos.get(keys) == [OK, OK]  # get 3


def test_fail_after_alone_kills_the_store_and_fail_calls_alone_fails_the_first_calls() -> None:
    dead = Chaos("fail_after=2")
    keys = _keys(2)
    dead.fill(keys)
    assert [_hit(dead.store.exists(keys)) for _ in range(6)] == [[], [], [0, 1], [0, 1], [0, 1], [0, 1]]
    flaky = Chaos("fail_calls=2")
    flaky.fill(keys)
    assert [_hit(flaky.store.exists(keys)) for _ in range(4)] == [[0, 1], [0, 1], [], []]


# -- scope -------------------------------------------------------------------------------------------------


def test_scope_counts_positions_among_matching_keys_only() -> None:
    """Group 1's keys are interleaved with group 0's: ``get_gap=1`` hits the second key of group 1."""
    chaos = Chaos("get_gap=1&exists_tail=0.5&fault_group=1")
    keys = [_block_key(group, 0, 0, i) for i in range(4) for group in (0, 1)]
    keys.append("hkv1/fuzz/manifest")  # a key of no block: out of any scope
    chaos.fill(keys)
    assert _hit(chaos.get(keys)) == [3]
    assert _hit(chaos.store.exists(keys)) == [5, 7], "the tail of group 1's four keys"


def test_scope_by_tp_and_dcp_rank() -> None:
    keys = [_block_key(0, tp_rank, tp_rank % 2, i) for i in range(2) for tp_rank in range(4)]
    by_tp = Chaos("exists_gap=0&fault_tp_rank=2,3")
    by_tp.fill(keys)
    assert _hit(by_tp.store.exists(keys)) == [2], "the first key of tp ranks 2 and 3"
    by_dcp = Chaos("exists_tail=1&fault_dcp_rank=1")
    by_dcp.fill(keys)
    assert _hit(by_dcp.store.exists(keys)) == [1, 3, 5, 7]
    both = Chaos("exists_tail=1&fault_group=0&fault_tp_rank=1&fault_dcp_rank=1")
    both.fill(keys)
    assert _hit(both.store.exists(keys)) == [1, 5], "every scope part must match"


def test_scope_applies_to_failed_calls_and_not_to_the_probabilities() -> None:
    keys = [_block_key(group, 0, 0, 0) for group in range(3)]
    run = Chaos("fail_calls=1&fault_group=2")
    run.fill(keys)
    assert run.store.exists(keys) == [OK, OK, FAILED]
    anywhere = Chaos("exists_fail=1&fault_group=2")
    assert anywhere.store.exists(keys) == [FAILED] * 3


def test_without_scope_any_key_takes_positions() -> None:
    chaos = Chaos("exists_gap=0")
    keys = ["not-a-block-key", _block_key(0, 0, 0, 0)]
    chaos.fill(keys)
    assert chaos.store.exists(keys) == [NOT_FOUND, OK]
    assert chaos.store.exists(keys[::-1]) == [NOT_FOUND, OK]


# -- URL -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "exists_gap=0,5&get_tail=0.25&put_random_gaps=2",
        "get_gap=3&fail_after=4&fail_calls=2&fail_ops=exists,put",
        "fail_after=9",
        "fail_calls=3&fault_group=0,2&fault_tp_rank=1&fault_dcp_rank=0",
        "exists_tail=0.1",
        "",
    ],
)
def test_patterns_query_reproduces_the_patterns(query: str) -> None:
    backend, _ = open_backend(f"faulty+memory://{uuid.uuid4().hex}?{query}&seed=1")
    assert isinstance(backend, FaultyBackend)
    assert backend.patterns.query() == query
    params = Params("faulty+memory://x", "faulty+", dict(parse_qsl(query)))
    assert read_fault_patterns(params) == backend.patterns
    params.finish()
    if not query:
        assert backend.patterns == NO_PATTERNS


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("exists_gap", ""),
        ("exists_gap", "-1"),
        ("get_gap", "1,1"),
        ("get_gap", "0,,5"),
        ("put_gap", "1,"),
        ("get_gap", " 1"),
        ("get_gap", "١"),
        ("get_gap", "99999999999999999999"),
        ("exists_tail", "1.5"),
        ("get_tail", "-0.1"),
        ("put_tail", "nan"),
        ("get_tail", "quarter"),
        ("exists_random_gaps", "-1"),
        ("get_random_gaps", "1.5"),
        ("fail_after", "-1"),
        ("fail_calls", "soon"),
        ("fail_ops", ""),
        ("fail_ops", "get,remove"),
        ("fail_ops", "get,get"),
        ("fault_group", ""),
        ("fault_tp_rank", "a"),
        ("fault_dcp_rank", "0,0"),
    ],
)
def test_a_bad_value_is_refused_naming_the_parameter(name: str, value: str) -> None:
    with pytest.raises(StoreError) as error:
        open_store(f"faulty+memory://x?{name}={value}")
    assert f"parameter {name}=" in str(error.value), str(error.value)
