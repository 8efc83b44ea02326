"""Stateful fuzzing of the lifecycle: random geometries x random stores x random failure interleavings.

``LifecycleFuzzMachine`` is a Hypothesis ``RuleBasedStateMachine``. Each run draws one geometry (full /
sliding-window / Mamba mixes, DCP 1-8 with TP a multiple of it, interleave, hash units, block sizes;
no sliding window under DCP, as in vLLM), a model store (a set of keys), and then interleaves: saves
(whole or partial, per rank), save waves that fail part-way, lookups with local hits, loads failing
per (rank, group, block) or split loads stopping early, evictions of store entries, preemptions and
finishes. At times a seeded positional fault pattern (``faulty+``'s gaps, tails and random gaps of
exists / get / put calls, a run of failed calls, scoped to some groups or ranks; the real
``FaultyBackend`` over the model store, ``hybridkv.testing.fault_patterns``) stands in front of the store:
lookups, loads and save waves then go through it. The hard rules are checked where they apply and as
invariants:

- a reported hit is restorable by every group on every rank (plan coverage + every key exists), on a
  first lookup and on the retry after a truncation alike; every planned key was answered present by the
  store (a gapped exists answer never yields a hit past the gap), and a probing search answers what the
  full scan answers over the store as the search saw it (its answers, gaps included);
- a slot a load answered ``OK`` holds exactly its own entry's bytes (what recomputing it gives), a slot
  that failed holds nothing;
- every planned key is derived from the request's own hashes (never mixed-prefix state);
- the retry cap of a truncation is exactly the largest aligned boundary (strictly below a plan with a
  faulted entry, never below the local hit) that no faulted entry (definite or transient) of any group
  on any rank is needed to restore (checked against a brute-force oracle), and exactly the blocks with
  a definite fault (``MISSING``, ``CORRUPT``) are invalidated, on every rank; timeouts, transport
  errors and unattempted entries keep their store entries;
- the retry's hit is at most the cap; retries are bounded (one, then ``MISS``);
- invalidated keys never exist in the model store afterwards (until a later save stores them again),
  so no later lookup plans them;
- every lifecycle terminates, the audit log replays clean (including: no hit past a recorded cap);
- ``BlockStored`` events name only entries stored on every rank.

Use it as ``run_state_machine_as_test(LifecycleFuzzMachine)`` or via ``TestLifecycleFuzz`` (pytest).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.audit.replay import replay_records
from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import EntryId, KeyScheme
from hybridkv.lifecycle.kinds import GroupKind, GroupSpec, cdiv
from hybridkv.lifecycle.load import LoadOutcome, LoadPlan
from hybridkv.lifecycle.lookup import plan_lookup
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.lifecycle.table import MAX_LOAD_RETRIES, State
from hybridkv.store.base import Status
from hybridkv.store.faulty import FaultyBackend
from hybridkv.testing.fault_patterns import (
    RECOMPUTED_NUM_BYTES,
    STATUS_TO_LOAD_OUTCOME,
    fault_patterns,
    faulty_model_store,
    recomputed_slot,
)

#: Load states the connector may refuse from (every live one but REFUSED).
_REFUSABLE = (
    State.NEW,
    State.LOOKUP,
    State.MISS,
    State.PARTIAL_HIT,
    State.LOADING,
    State.VERIFIED,
    State.TRUNCATED,
)
from hybridkv.lifecycle.save import plan_save
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

__all__ = ["LifecycleFuzzMachine", "TestLifecycleFuzz", "family_hashes", "geometries"]

#: Load faults a rank may report for an entry that is in the store.
_FAULTS = (LoadOutcome.CORRUPT, LoadOutcome.MISSING, LoadOutcome.TIMEOUT, LoadOutcome.TRANSPORT_ERROR)


@st.composite
def geometries(draw: st.DrawFn, *, max_groups: int = 3) -> Geometry:
    """Geometries vLLM accepts: spans divisible by the hash unit, no sliding window under DCP."""
    dcp = draw(st.sampled_from([1, 1, 1, 2, 4, 8]))
    tp = dcp * draw(st.sampled_from([1, 1, 2]))
    unit = draw(st.sampled_from([2, 4, 8]))
    num_groups = draw(st.integers(1, max_groups))
    kinds = [GroupKind.FULL, GroupKind.MAMBA] + ([GroupKind.SLIDING_WINDOW] if dcp == 1 else [])
    groups = []
    for _ in range(num_groups):
        kind = draw(st.sampled_from(kinds))
        block_size = unit * draw(st.sampled_from([1, 1, 2, 3, 4]))
        if kind is GroupKind.FULL:
            groups.append(GroupSpec.full(block_size, layout=draw(st.sampled_from(["mha", "mla"]))))
        elif kind is GroupKind.MAMBA:
            groups.append(GroupSpec.mamba(block_size))
        else:
            window = draw(st.integers(1, 4 * block_size))
            groups.append(GroupSpec.sliding_window_group(block_size, window))
    sharded_sizes = [g.block_size for g in groups if g.dcp_sharded]
    interleave = 1
    if dcp > 1 and sharded_sizes:
        base = math.gcd(*sharded_sizes)
        interleave = draw(st.sampled_from([d for d in range(1, base + 1) if base % d == 0]))
    topology = Topology(tp_size=tp, dcp_size=dcp, interleave=interleave)
    spans = [g.block_size * (dcp if g.dcp_sharded else 1) for g in groups]
    prefix_match_unit = None
    if len(groups) > 1 and draw(st.booleans()):
        base = math.gcd(*spans)
        prefix_match_unit = draw(st.sampled_from([d for d in range(1, base + 1) if base % d == 0]))
    return Geometry(groups=tuple(groups), topology=topology, prefix_match_unit=prefix_match_unit)


def family_hashes(family: int, num_units: int) -> list[bytes]:
    """Chained-looking hashes: requests of one family share every prefix, families share nothing."""
    return [hashlib.blake2b(f"{family}:{i}".encode(), digest_size=8).digest() for i in range(num_units)]


@dataclass
class _Req:
    lifecycle: RequestLifecycle
    family: int
    num_tokens: int
    hashes: list[bytes]
    num_computed_tokens: int = 0
    #: Tightest cap any truncation imposed on this incarnation.
    cap: int | None = None
    #: Whether the current LOOKUP / PARTIAL_HIT / LOADING is the retry after a truncation.
    retrying: bool = False
    num_loads: int = 0
    num_truncations: int = 0
    #: Per entry: was it loaded OK on its rank (last load).
    history: list[str] = field(default_factory=list)


class LifecycleFuzzMachine(RuleBasedStateMachine):
    """Drives ``LifecycleMachine`` + geometry against a set-of-keys model store."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, _Req] = {}
        self.store: set[str] = set()
        self.events_published: list[tuple[str, ...]] = []
        self.num_requests = 0
        self.num_waves = 0
        self.live_waves: list[Any] = []
        #: Keys a truncation invalidated and no save has stored again since.
        self.invalidated: set[str] = set()
        #: The seeded positional faults in front of ``store`` (``store_fault_patterns``), if any.
        self.faulty: FaultyBackend | None = None

    @initialize(geometry=geometries())
    def setup(self, geometry: Geometry) -> None:
        note(f"geometry: {json.dumps(geometry.describe())}")
        self.geometry = geometry
        self.scheme = KeyScheme(namespace="fuzz", model="fuzz-model", geometry=geometry)
        self.sink = MemoryAuditSink()
        self.machine = LifecycleMachine(self.scheme, sink=self.sink)
        self.max_tokens = 10 * max(geometry.spans) + 3

    # -- helpers -------------------------------------------------------------------------------------

    def _keys(self, group: int, boundary: int, hashes: list[bytes]) -> list[str]:
        block_hash = self.scheme.boundary_hash(hashes, boundary)
        return [self.scheme.key(group, r.tp_rank, block_hash) for r in self.geometry.topology.ranks]

    def _draw_boundaries(self, data: st.DataObject, group: int, num_tokens: int) -> list[int]:
        geometry = self.geometry
        unit = geometry.hash_unit
        span = geometry.spans[group]
        kind = geometry.groups[group].kind
        max_units = num_tokens // unit
        if max_units == 0:
            return []
        if kind is GroupKind.FULL:
            # Whole blocks from the left, maybe a prompt tail at its last hash boundary.
            end = data.draw(st.integers(0, max_units)) * unit
            boundaries = list(range(span, end - end % span + 1, span)) if end >= span else []
            if end % span and data.draw(st.booleans()):
                boundaries.append(end)
            return boundaries
        if kind is GroupKind.SLIDING_WINDOW:
            candidates = list(range(span, max_units * unit + 1, span))
            return data.draw(st.lists(st.sampled_from(candidates), unique=True)) if candidates else []
        candidates = list(range(unit, max_units * unit + 1, unit))
        return data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=4))

    def _store_add(self, keys: list[str] | tuple[str, ...]) -> None:
        self.store.update(keys)
        self.invalidated.difference_update(keys)

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """The store's answer to one exists call: the model, through the fault patterns if any."""
        if self.faulty is None:
            return [key in self.store for key in keys]
        return [status is Status.OK for status in self.faulty.exists(keys)]

    def _load_through_patterns(self, plan: LoadPlan, tp_rank: int) -> dict[EntryId, LoadOutcome]:
        """One rank's load as one get of its planned keys through the fault patterns. A slot answered
        ``OK`` must hold its own entry's bytes (a gap shifts no bytes to another slot); any other slot
        must be untouched."""
        assert self.faulty is not None
        rank_loads = plan.loads_for_rank(tp_rank)
        slots = [bytearray(RECOMPUTED_NUM_BYTES) for _ in rank_loads]
        statuses = self.faulty.get_frames_into(
            [key for _, key in rank_loads], [[memoryview(slot)] for slot in slots]
        )
        outcomes = {}
        for (load, key), status, slot in zip(rank_loads, statuses, slots, strict=True):
            expected = recomputed_slot(key) if status is Status.OK else bytes(RECOMPUTED_NUM_BYTES)
            assert slot == expected, (
                f"rank {tp_rank}: the slot of {key} ({status.name}) holds {slot.hex()}, not {expected.hex()}"
            )
            outcomes[load.entry(tp_rank)] = STATUS_TO_LOAD_OUTCOME[status]
        return outcomes

    def _put_through_patterns(
        self, entries: Sequence[tuple[EntryId, str]], sent: Mapping[EntryId, bool]
    ) -> dict[EntryId, bool]:
        """Each rank's put of its entries that reach the store (``sent``) as one call through the fault
        patterns: stored exactly where it answered ``OK``."""
        assert self.faulty is not None
        stored = dict(sent)
        for rank in self.geometry.topology.ranks:
            batch = [(entry, key) for entry, key in entries if entry.tp_rank == rank.tp_rank and sent[entry]]
            statuses = self.faulty.put_frames([key for _, key in batch], [[] for _ in batch])
            for (entry, _), status in zip(batch, statuses, strict=True):
                stored[entry] = status is Status.OK
        return stored

    # -- store faults ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def store_fault_patterns(self, data: st.DataObject) -> None:
        """Seeded positional faults in front of the store (gaps, tails, random gaps; a run of failed calls;
        scoped to some groups or ranks), or none: lookups, loads and save waves go through them from now."""
        if data.draw(st.booleans(), label="no store faults"):
            self.faulty = None
            return
        self._arm_fault_patterns(data)

    def _arm_fault_patterns(self, data: st.DataObject) -> None:
        patterns = data.draw(fault_patterns(self.geometry), label="fault patterns")
        self.faulty = faulty_model_store(self.store, patterns, data.draw(st.integers(0, 7), label="seed"))
        note(f"store faults: {self.faulty.url}")

    # -- store-side rules ----------------------------------------------------------------------------

    @rule(data=st.data(), family=st.integers(0, 2))
    def previous_request_saved(self, data: st.DataObject, family: int) -> None:
        """Entries some earlier request stored: per group a boundary set, per rank maybe missing."""
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="saved_tokens")
        hashes = family_hashes(family, num_tokens // self.geometry.hash_unit)
        partial = data.draw(st.booleans(), label="some_ranks_missing")
        for group in range(self.geometry.num_groups):
            for boundary in self._draw_boundaries(data, group, num_tokens):
                for key in self._keys(group, boundary, hashes):
                    if not partial or data.draw(st.booleans()):
                        self._store_add([key])

    @rule(data=st.data(), family=st.integers(0, 1))
    def previous_request_saved_everything(self, data: st.DataObject, family: int) -> None:
        """A complete save of an earlier prompt: every group's every boundary on every rank."""
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="saved_tokens")
        unit = self.geometry.hash_unit
        hashes = family_hashes(family, num_tokens // unit)
        for group in range(self.geometry.num_groups):
            for boundary in range(unit, len(hashes) * unit + 1, unit):
                kind = self.geometry.groups[group].kind
                if (
                    kind is not GroupKind.MAMBA
                    and boundary % self.geometry.spans[group]
                    and boundary != len(hashes) * unit
                ):
                    continue  # attention groups store whole blocks and the prompt tail only
                self._store_add(self._keys(group, boundary, hashes))

    @precondition(lambda self: bool(self.store))
    @rule(data=st.data())
    def store_evicts_middle(self, data: st.DataObject) -> None:
        """A hole in the middle of a saved prefix (LRU eviction, a lost node): one entry of one group at
        an interior boundary, on some ranks or all, while the entries on both sides stay."""
        parts = data.draw(st.sampled_from(sorted(self.store))).split("/")
        group, block_hash = int(parts[3].removeprefix("g")), bytes.fromhex(parts[-1])
        ranks = [r.tp_rank for r in self.geometry.topology.ranks]
        lost = data.draw(st.lists(st.sampled_from(ranks), min_size=1, unique=True), label="ranks lost")
        self.store.difference_update(self.scheme.key(group, rank, block_hash) for rank in lost)

    @precondition(lambda self: bool(self.store))
    @rule(data=st.data())
    def store_evicts(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(sorted(self.store)), max_size=6, unique=True))
        self.store.difference_update(victims)

    # -- save waves -----------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def save_wave(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[request_id]
        group_to_boundaries = {
            g: self._draw_boundaries(data, g, req.num_tokens) for g in range(self.geometry.num_groups)
        }
        plan = plan_save(self.scheme, req.hashes, group_to_boundaries)
        self.num_waves += 1
        wave = self.machine.new_save_wave(request_id, self.num_waves, plan)
        if data.draw(st.integers(0, 4)) == 0:
            wave.drop()
            return
        wave.start_put()
        outcomes = {entry: data.draw(st.integers(0, 5)) > 0 for entry, _ in plan.entries}
        if self.faulty is not None:
            outcomes = self._put_through_patterns(plan.entries, outcomes)
        for entry, key in plan.entries:
            if outcomes[entry]:
                self._store_add([key])
        events = wave.finish_put(outcomes)
        event(f"save wave: {wave.state}")
        for block in events:
            keys = [
                self.scheme.key(block.group_index, r.tp_rank, block.block_hash)
                for r in self.geometry.topology.ranks
            ]
            assert all(key in self.store for key in keys), (
                f"BlockStored published for group {block.group_index} block {block.block_index} "
                "but not every rank's entry is stored"
            )
            self.events_published.append(tuple(keys))
        assert wave.current in (State.STORED, State.FAILED), f"wave ended in {wave.state}"

    # -- request rules ---------------------------------------------------------------------------------

    @rule(data=st.data(), family=st.integers(0, 1))
    def new_request(self, data: st.DataObject, family: int) -> None:
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="num_tokens")
        request_id = f"req-{self.num_requests}"
        self.num_requests += 1
        hashes = family_hashes(family, num_tokens // self.geometry.hash_unit)
        self.requests[request_id] = _Req(self.machine.new_request(request_id), family, num_tokens, hashes)

    def _live(self, *states: State) -> list[str]:
        return sorted(r for r, req in self.requests.items() if req.lifecycle.current in states)

    @precondition(
        lambda self: bool(
            self._live(State.NEW, State.MISS, State.PARTIAL_HIT, State.TRUNCATED, State.REFUSED)
        )
    )
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        request_id = data.draw(
            st.sampled_from(
                self._live(State.NEW, State.MISS, State.PARTIAL_HIT, State.TRUNCATED, State.REFUSED)
            )
        )
        req = self.requests[request_id]
        block = self.geometry.scheduler_block_size
        local = data.draw(st.integers(0, max(0, req.num_tokens - 1) // block), label="local_blocks") * block
        self._lookup(data, req, local, may_be_unavailable=True)

    def _lookup(self, data: st.DataObject, req: _Req, local: int, *, may_be_unavailable: bool) -> None:
        req.num_computed_tokens = local
        was_truncated = req.lifecycle.current is State.TRUNCATED
        was_refused = req.lifecycle.current is State.REFUSED
        # The connector's probing search (a few batched rounds), or the full scan; the search must
        # answer exactly what the full scan answers over the same store, holes included.
        probing = data.draw(st.booleans(), label="probing search")
        search = req.lifecycle.start_search(req.hashes, req.num_tokens, local)
        if search is None:
            assert was_truncated or was_refused, "a lookup was refused without a reason"
            assert req.lifecycle.current is State.REFUSED and not req.lifecycle.may_hit
            return
        if may_be_unavailable and data.draw(st.integers(0, 9)) == 0:
            req.lifecycle.lookup_unavailable("timeout")
            assert req.lifecycle.num_external_tokens == 0
            return
        # key -> present, as the store answered this lookup (through the fault patterns, gaps included)
        answered: dict[str, bool] = {}

        def exists(keys: Sequence[str]) -> list[bool]:
            found = self._exists(keys)
            answered.update(zip(keys, found, strict=True))
            return found

        if probing:
            found = search.run(exists)
            full = plan_lookup(
                self.scheme, req.hashes, req.num_tokens, local, max_boundary=search.max_boundary
            )
            # The store as the search saw it: its answers where it asked, the model where it did not.
            expected = full.resolve([answered.get(key, key in self.store) for key in full.keys])
            assert (found.boundary, found.plan) == (expected.boundary, expected.plan), (
                f"probing search found {found.boundary}, the full scan {expected.boundary}"
            )
            event(f"search: {search.num_round_trips} round trips")
            result = req.lifecycle.finish_search(found)
        else:  # the full scan: one exists of every candidate key, resolved by the lifecycle's rules
            candidates = plan_lookup(
                self.scheme, req.hashes, req.num_tokens, local, max_boundary=search.max_boundary
            )
            result = req.lifecycle.finish_search(candidates.resolve(exists(candidates.keys)))
        if self.faulty is not None:
            gapped = any(not found and key in self.store for key, found in answered.items())
            event(f"lookup through fault patterns: {'gapped' if gapped else 'whole'} answer")
        req.retrying = was_truncated
        geometry = self.geometry
        assert result.boundary % geometry.hit_alignment == 0, f"boundary {result.boundary} is not aligned"
        assert result.boundary <= max(0, req.num_tokens - 1), "the hit leaves no token to recompute"
        if req.cap is not None:
            assert result.boundary <= max(req.cap, 0) or not result.is_hit, (
                f"lookup after truncation returned {result.boundary} > truncated boundary {req.cap}"
            )
        event(("retry" if was_truncated else "lookup") + (": hit" if result.is_hit else ": miss"))
        if result.is_hit:
            assert result.plan is not None and result.boundary > local
            self._check_plan_restorable(req, result.plan, local, answered)
        else:
            assert req.lifecycle.num_external_tokens == 0

    def _check_plan_restorable(
        self, req: _Req, plan: LoadPlan, local: int, answered: Mapping[str, bool]
    ) -> None:
        """Hard rule 1: every group on every rank can restore the boundary from local + plan, each planned
        key being one the lookup's store ``answered`` present."""
        geometry = self.geometry
        boundary = plan.boundary
        planned = {(load.group_index, load.block_index): load for load in plan.loads}
        for load in plan.loads:
            assert load.block_hash == self.scheme.boundary_hash(req.hashes, load.key_boundary), (
                f"group {load.group_index} block {load.block_index}: key from another prefix (mixed-prefix state)"
            )
            for key in self._keys(load.group_index, load.key_boundary, req.hashes):
                assert key in self.store, f"planned key {key} does not exist: a hit some rank cannot restore"
                assert answered.get(key) is True, (
                    f"planned key {key} was not answered present: a hit past a gap in the exists answer"
                )
                assert key not in self.invalidated, f"planned key {key} was invalidated by a truncation"
        for g, (group, span) in enumerate(zip(geometry.groups, geometry.spans, strict=True)):
            if group.kind is GroupKind.FULL:
                for i in range(cdiv(boundary, span)):
                    if (i + 1) * span <= local:
                        continue
                    block = planned.get((g, i))
                    assert block is not None, (
                        f"full group {g}: block {i} of a {boundary}-token hit is not planned"
                    )
                    assert i * span < block.key_boundary <= (i + 1) * span, (
                        f"group {g}: entry {block} not in block {i}"
                    )
                    assert block.key_boundary >= min((i + 1) * span, boundary), (
                        f"group {g}: block {i} entry ends at {block.key_boundary} < hit {boundary}"
                    )
            elif group.kind is GroupKind.SLIDING_WINDOW:
                assert group.sliding_window is not None and boundary % span == 0
                needed = max(1, cdiv(group.sliding_window - 1, span))
                for i in range(max(0, boundary // span - needed), boundary // span):
                    assert (i + 1) * span <= local or (g, i) in planned, (
                        f"swa group {g}: window block {i} missing"
                    )
            else:
                # Always from the store, even when the local hit reaches this block: a recurrent state at
                # the local hit is never reused past it (what makes divergent local hits exact, where
                # vLLM's local full-attention hit runs past any local state).
                state = planned.get((g, cdiv(boundary, span) - 1))
                assert state is not None and state.key_boundary == boundary, (
                    f"mamba group {g}: no state exactly at {boundary} in block {cdiv(boundary, span) - 1}"
                )

    @precondition(lambda self: bool(self._live(State.PARTIAL_HIT)))
    @rule(data=st.data())
    def scheduler_takes_hit(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._live(State.PARTIAL_HIT)))
        req = self.requests[request_id]
        if data.draw(st.integers(0, 5)) == 0:
            req.lifecycle.decline()
            return
        stale = req.lifecycle.is_stale
        started = req.lifecycle.start_load()
        assert started == (not stale), f"{request_id}: a load of a hit answered before a reset started"
        if not started:
            req.lifecycle.refuse("the hit was answered before a namespace reset")
            return
        req.num_loads += 1
        assert req.num_loads <= 1 + MAX_LOAD_RETRIES, (
            f"{request_id}: load #{req.num_loads}: retries unbounded"
        )

    @precondition(lambda self: bool(self._live(*_REFUSABLE)))
    @rule(data=st.data())
    def connector_refuses(self, data: st.DataObject) -> None:
        """The connector refuses what vLLM allocated (no plan, a mismatch): final for the incarnation."""
        request_id = data.draw(st.sampled_from(self._live(*_REFUSABLE)))
        req = self.requests[request_id]
        req.lifecycle.refuse("allocation does not match the plan")
        assert not req.lifecycle.may_hit and req.lifecycle.num_external_tokens == 0

    @rule(data=st.data())
    def namespace_reset(self, data: st.DataObject) -> None:
        """A namespace reset: the store is emptied; hits answered before it are stale. The connector
        revokes them at once (or, drawn, leaves one for the ``answer_current`` guard to refuse)."""
        self.machine.begin_epoch()
        self.store.clear()
        self.events_published.clear()  # the reset's AllBlocksCleared
        for req in self.requests.values():
            if req.lifecycle.current is State.PARTIAL_HIT and data.draw(st.booleans(), label="revoke now"):
                req.lifecycle.revoke("namespace reset")
                assert req.lifecycle.num_external_tokens == 0

    @precondition(lambda self: bool(self._live(State.LOADING)))
    @rule(data=st.data())
    def load_finishes(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._live(State.LOADING)))
        req = self.requests[request_id]
        modes = ["ok", "ok", "random", "split"] + (["patterns", "patterns"] if self.faulty else [])
        mode = data.draw(st.sampled_from(modes), label="load_mode")
        self._load(data, req, mode)

    def _load(self, data: st.DataObject, req: _Req, mode: str) -> None:
        """Finish ``req``'s load: "ok", "random" failures, "split" (a rank stops at its first failure),
        "fail" (at least one entry of the plan fails on some rank), or "patterns" (each rank's batch
        through the fault patterns)."""
        lookup = req.lifecycle.lookup
        assert lookup is not None and lookup.plan is not None
        plan = lookup.plan
        forced = (
            data.draw(st.sampled_from(plan.entries), label="forced_failure")[0] if mode == "fail" else None
        )
        outcomes: dict[EntryId, LoadOutcome] = {}
        for tp_rank in range(self.geometry.topology.tp_size):
            if mode == "patterns":
                rank_outcomes = self._load_through_patterns(plan, tp_rank)
                outcomes.update(rank_outcomes)
                faulted = any(outcome.is_fault for outcome in rank_outcomes.values())
                event(f"load through fault patterns: a rank's batch {'faulted' if faulted else 'loaded'}")
                continue
            failed_early = False
            cut = data.draw(st.integers(0, len(plan.loads) + 2)) if mode == "split" else None
            for position, (load, key) in enumerate(plan.loads_for_rank(tp_rank)):
                entry = EntryId(tp_rank, load.group_index, load.block_index, load.key_boundary)
                if failed_early:
                    continue  # not attempted
                if key not in self.store:
                    outcome = LoadOutcome.MISSING  # evicted between lookup and load
                elif (
                    entry == forced
                    or (mode == "split" and position == cut)
                    or (mode in ("random", "fail") and data.draw(st.integers(0, 4)) == 0)
                ):
                    outcome = data.draw(st.sampled_from(_FAULTS), label="fault")
                else:
                    outcome = LoadOutcome.OK
                outcomes[entry] = outcome
                if mode == "split" and outcome.is_fault:
                    failed_early = True
        resolution = req.lifecycle.finish_load(outcomes)
        all_ok = all(outcomes.get(entry) is LoadOutcome.OK for entry, _ in plan.entries)
        assert resolution.verified == all_ok
        cap = resolution.retry_cap
        event(
            "load: verified"
            if resolution.verified
            else f"load: truncated (retry={req.retrying}, cap>local: {cap > req.num_computed_tokens})"
        )
        if resolution.verified:
            assert req.lifecycle.current is State.VERIFIED
            return
        assert req.lifecycle.current is State.TRUNCATED
        req.num_truncations += 1
        local = req.num_computed_tokens - req.num_computed_tokens % self.geometry.scheduler_block_size
        assert local <= cap <= plan.boundary and cap % self.geometry.hit_alignment == 0, (
            f"retry cap {cap} outside [{local}, {plan.boundary}] or unaligned"
        )
        not_attempted = LoadOutcome.NOT_ATTEMPTED
        failed = [entry for entry, _ in plan.entries if outcomes.get(entry, not_attempted).is_fault]
        assert set(resolution.failed_entries) == set(failed)
        assert cap == self._oracle_cap(plan.boundary, failed), (
            f"retry cap {cap} != oracle {self._oracle_cap(plan.boundary, failed)} (failed: {failed})"
        )
        invalid = set(resolution.invalid_keys)
        # Only definite faults remove entries, each on every rank; transient faults and unattempted
        # entries keep theirs (hard rule 3 bars them for this request through the cap alone).
        bad_blocks = {
            (e.group_index, e.block_index, e.key_boundary)
            for e, _ in plan.entries
            if outcomes.get(e, not_attempted).invalidates
        }
        expected = {
            key for e, key in plan.entries if (e.group_index, e.block_index, e.key_boundary) in bad_blocks
        }
        assert invalid == expected, (
            f"invalidated {sorted(invalid - expected)} (not a definite fault), kept {sorted(expected - invalid)}"
        )
        self.store.difference_update(invalid)
        self.invalidated |= invalid
        req.cap = cap if req.cap is None else min(req.cap, cap)
        assert req.lifecycle.max_boundary == req.cap, (
            f"lifecycle cap {req.lifecycle.max_boundary} != the tightest truncation cap {req.cap}"
        )

    def _oracle_cap(self, planned: int, failed: list[EntryId]) -> int:
        """Brute force: the largest aligned boundary (strictly below ``planned`` if anything failed)
        none of whose needed (group, block[, boundary]) entries failed on any rank."""
        geometry = self.geometry
        alignment = geometry.hit_alignment
        top = planned - 1 if failed else planned
        bad = {(e.group_index, e.block_index) for e in failed}
        bad_states = {(e.group_index, e.key_boundary) for e in failed}
        for boundary in range(top - top % alignment, 0, -alignment):
            needed: set[tuple[int, int]] = set()
            blocked = False
            for g, (group, span) in enumerate(zip(geometry.groups, geometry.spans, strict=True)):
                if group.kind is GroupKind.FULL:
                    needed.update((g, i) for i in range(cdiv(boundary, span)))
                elif group.kind is GroupKind.SLIDING_WINDOW:
                    assert group.sliding_window is not None
                    window = max(1, cdiv(group.sliding_window - 1, span)) * span
                    # every block holding a token of [boundary - window, boundary)
                    needed.update((g, p // span) for p in range(max(0, boundary - window), boundary))
                else:
                    blocked |= (g, boundary) in bad_states
            if not blocked and not (needed & bad):
                return boundary
        return 0

    @rule(data=st.data(), family=st.integers(0, 1))
    def stored_prompt_fails_then_retries(self, data: st.DataObject, family: int) -> None:
        """The scenario the retry cap exists for: a prompt stored at every boundary (Mamba states at
        every hand-off), reloaded by a new request, some entry fails, vLLM restarts it from 0 and the
        one retry looks up again under the cap (and, if it hits, loads: ``load_finishes`` judges it)."""
        self.previous_request_saved_everything(data, family)
        self.new_request(data, family)
        request_id = f"req-{self.num_requests - 1}"
        req = self.requests[request_id]
        self._lookup(data, req, 0, may_be_unavailable=False)
        if req.lifecycle.current is not State.PARTIAL_HIT:
            return
        req.lifecycle.start_load()
        req.num_loads += 1
        self._load(data, req, "fail")
        # (``state``, not ``current``: a type checker keeps ``current`` narrowed to PARTIAL_HIT from above)
        assert req.lifecycle.state == State.TRUNCATED.name
        self._lookup(data, req, 0, may_be_unavailable=False)  # vLLM's recompute policy: from 0
        if req.lifecycle.current is State.PARTIAL_HIT:
            req.lifecycle.start_load()
            req.num_loads += 1

    @rule(data=st.data(), family=st.integers(0, 1))
    def stored_prompt_loads_through_fault_patterns(self, data: st.DataObject, family: int) -> None:
        """A prompt stored at every boundary, looked up and loaded by a new request through freshly drawn
        positional faults (the lookup may meet a gap, a rank's load batch a failed tail or a failed run);
        after a truncation the one retry goes through them too (and, if it hits, ``load_finishes`` judges
        its load)."""
        self.previous_request_saved_everything(data, family)
        self._arm_fault_patterns(data)
        self.new_request(data, family)
        req = self.requests[f"req-{self.num_requests - 1}"]
        self._lookup(data, req, 0, may_be_unavailable=False)
        if req.lifecycle.current is not State.PARTIAL_HIT:
            return
        req.lifecycle.start_load()
        req.num_loads += 1
        self._load(data, req, "patterns")
        # (``state``, not ``current``: a type checker keeps ``current`` narrowed to PARTIAL_HIT from above)
        if req.lifecycle.state == State.TRUNCATED.name:
            self._lookup(data, req, 0, may_be_unavailable=False)  # vLLM's recompute policy: from 0
            if req.lifecycle.current is State.PARTIAL_HIT:
                req.lifecycle.start_load()
                req.num_loads += 1

    @precondition(lambda self: bool(self._live(*(s for s in State if s not in (State.EVICTED,)))))
    @rule(data=st.data(), reason=st.sampled_from(["finished", "aborted", "preempted"]))
    def request_leaves(self, data: st.DataObject, reason: str) -> None:
        live = self._live(*(s for s in State if s is not State.EVICTED))
        request_id = data.draw(st.sampled_from(live))
        req = self.requests.pop(request_id)
        req.lifecycle.evict(reason)
        if reason == "preempted":
            # The scheduler will see it again: a fresh incarnation under the same id.
            self.requests[request_id] = _Req(
                self.machine.new_request(request_id), req.family, req.num_tokens, req.hashes
            )

    # -- invariants --------------------------------------------------------------------------------------

    @invariant()
    def one_record_per_transition(self) -> None:
        if hasattr(self, "sink"):
            assert len(self.sink.records) == self.machine.num_transitions, (
                f"{self.machine.num_transitions} transitions but {len(self.sink.records)} audit records"
            )

    @invariant()
    def invalidated_keys_stay_gone(self) -> None:
        if hasattr(self, "invalidated"):
            assert not (self.invalidated & self.store), "an invalidated key is reported as existing"

    @invariant()
    def retries_bounded(self) -> None:
        for request_id, req in self.requests.items():
            assert req.lifecycle.num_retries <= MAX_LOAD_RETRIES, (
                f"{request_id}: {req.lifecycle.num_retries} retries"
            )
            assert req.num_truncations <= 1 + MAX_LOAD_RETRIES, (
                f"{request_id}: {req.num_truncations} truncations"
            )

    def teardown(self) -> None:
        if not hasattr(self, "machine"):
            return
        for req in self.requests.values():
            req.lifecycle.evict("shutdown")
        report = replay_records(json.dumps(record) for record in self.sink.records)
        assert report.ok, f"audit replay found violations: {report.violations[:5]}"
        assert report.num_terminated == report.num_lifecycles, "some lifecycle never terminated"


TestLifecycleFuzz = LifecycleFuzzMachine.TestCase
