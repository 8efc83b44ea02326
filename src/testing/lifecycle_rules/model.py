"""The lifecycle fuzz machine's model: its draws, its state and the helpers every rule group shares.

``LifecycleModel`` holds what a run has built so far (the geometry and key scheme drawn by its one
``initialize`` rule, the lifecycle machine and its audit sink, the requests, the model store as a set of
keys, the seeded fault patterns in front of it) and the helpers the rules call: a boundary's keys on
every rank, drawn save boundaries, the store's answer to an exists, a load or a put through the patterns.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import EntryId, KeyScheme
from hybridkv.lifecycle.kinds import GroupKind, GroupSpec
from hybridkv.lifecycle.load import LoadOutcome, LoadPlan
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import MemoryAuditSink
from hybridkv.lifecycle.table import State
from hybridkv.store.base import Status
from hybridkv.store.faulty import FaultyBackend
from hybridkv.testing.fault_patterns import RECOMPUTED_NUM_BYTES, STATUS_TO_LOAD_OUTCOME, recomputed_slot
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

__all__ = ["FuzzRequest", "LifecycleModel", "family_hashes", "geometries"]


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
class FuzzRequest:
    """One request the machine drives: its lifecycle and what the oracles need to judge it."""

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


class LifecycleModel(RuleBasedStateMachine):
    """The state of one run and the helpers its rules share (the rules live in the other modules of
    ``hybridkv.testing.lifecycle_rules``; ``hybridkv.testing.lifecycle_fuzz`` puts them together)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, FuzzRequest] = {}
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

    def _live(self, *states: State) -> list[str]:
        return sorted(r for r, req in self.requests.items() if req.lifecycle.current in states)
