"""Seeded positional store faults for the lifecycle fuzzer: ``faulty+``'s patterns over a model store.

- ``ModelStoreBackend``: a store ``Backend`` over a set of keys (the fuzzer's model store), so that the real
  ``FaultyBackend`` -- the code behind ``faulty+URL?exists_gap=...`` -- stands between the fuzzer's lookups,
  loads and saves and that set.
- ``fault_patterns(geometry)``: a Hypothesis strategy of ``FaultPatterns`` (gaps, tails and seeded random
  gaps of exists / get / put calls, a run of failed calls, a scope of groups and ranks) for a geometry.
- ``recomputed_slot(key)``: what a loaded slot must hold: the bytes recomputing the entry's prefix gives
  (a digest of its key stands for them; the model backend's ``get`` writes exactly that).
- ``STATUS_TO_LOAD_OUTCOME``: what the worker makes of a ``get``'s status for a planned entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence

from hybridkv.connector.outcomes import STATUS_MEANINGS
from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status, StoreStats
from hybridkv.store.faulty import FaultyBackend
from hybridkv.store.faulty_patterns import PATTERN_OPS, FaultPatterns, FaultScope, OpPattern
from hybridkv.store.framed import FrameParts
from hypothesis import strategies as st

__all__ = [
    "RECOMPUTED_NUM_BYTES",
    "STATUS_TO_LOAD_OUTCOME",
    "ModelStoreBackend",
    "fault_patterns",
    "faulty_model_store",
    "recomputed_slot",
]

#: The size of one entry's slot in the fuzzer's loads.
RECOMPUTED_NUM_BYTES = 8

#: What the worker makes of a ``get``'s status for a planned entry: the load column of the connector's one
#: mapping (``hybridkv.connector.outcomes.STATUS_MEANINGS``): only ``NOT_FOUND`` and ``CORRUPT`` are definite
#: faults, which invalidate the entry.
STATUS_TO_LOAD_OUTCOME: Mapping[Status, LoadOutcome] = {
    status: meaning.load for status, meaning in STATUS_MEANINGS.items()
}


def recomputed_slot(key: str) -> bytes:
    """The bytes the entry stored under ``key`` restores into its slot: what recomputing it gives."""
    return hashlib.blake2b(key.encode(), digest_size=RECOMPUTED_NUM_BYTES).digest()


class ModelStoreBackend:
    """A ``Backend`` over ``keys``, a live set the caller keeps changing (it is not copied).

    ``exists`` answers membership; ``get_frames_into`` writes ``recomputed_slot(key)`` into a present
    key's one-part frame (``OK``) and leaves an absent key's alone (``NOT_FOUND``). ``put_frames`` answers
    ``OK`` and stores nothing: the fuzzer adds what a save stored itself, with its own bookkeeping."""

    url = "model://lifecycle-fuzz"

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def answers_late(self, op: str) -> bool:
        return False

    def exists(self, keys: Sequence[str]) -> list[Status]:
        return [Status.OK if key in self.keys else Status.NOT_FOUND for key in keys]

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return [Status.OK] * len(keys)

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        statuses = []
        for key, frame in zip(keys, frames, strict=True):
            if key not in self.keys:
                statuses.append(Status.NOT_FOUND)
                continue
            (slot,) = frame
            slot[:] = recomputed_slot(key)
            statuses.append(Status.OK)
        return statuses

    def remove(self, keys: Sequence[str]) -> list[Status]:
        statuses = [Status.OK if key in self.keys else Status.NOT_FOUND for key in keys]
        self.keys.difference_update(keys)
        return statuses

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        return iter(sorted(key for key in self.keys if key.startswith(prefix)))

    def remove_prefix(self, prefix: str) -> int:
        doomed = [key for key in self.keys if key.startswith(prefix)]
        self.keys.difference_update(doomed)
        return len(doomed)

    def stats(self) -> StoreStats:
        return StoreStats(self.url, num_keys=len(self.keys))

    def close(self) -> None:
        pass


def faulty_model_store(keys: set[str], patterns: FaultPatterns, seed: int) -> FaultyBackend:
    """``patterns`` (with ``seed``) in front of the model store ``keys``; its ``url`` is the ``faulty+``
    query that reproduces them."""
    query = "&".join(part for part in (patterns.query(), f"seed={seed}") if part)
    return FaultyBackend(
        f"faulty+model://lifecycle-fuzz?{query}", ModelStoreBackend(keys), patterns=patterns, seed=seed
    )


#: One operation's positional faults: often none, else a gap, a tail, both, or seeded random gaps.
_OP_PATTERNS = st.sampled_from(
    [
        OpPattern(),
        OpPattern(),
        OpPattern(),
        OpPattern(gap=(0,)),
        OpPattern(gap=(1,)),
        OpPattern(gap=(2, 5)),
        OpPattern(tail=0.1),
        OpPattern(tail=0.5),
        OpPattern(tail=1.0),
        OpPattern(gap=(0,), tail=0.25),
        OpPattern(num_random_gaps=1),
        OpPattern(num_random_gaps=2),
    ]
)
#: (``fail_after``, ``fail_calls``): mostly no failed run; else a short run, or a store that dies.
_FAILED_RUNS = st.sampled_from([(0, 0), (0, 0), (0, 0), (0, 1), (2, 1), (1, 3), (4, 2), (3, None)])
_FAIL_OPS = st.sampled_from(
    [frozenset(PATTERN_OPS), frozenset({"exists"}), frozenset({"get"}), frozenset({"get", "put"})]
)


def _scope_part(num_values: int) -> st.SearchStrategy[frozenset[int] | None]:
    """Mostly every value (``None``), else one of ``range(num_values)``."""
    return st.sampled_from([None, None, *(frozenset({value}) for value in range(num_values))])


@st.composite
def fault_patterns(draw: st.DrawFn, geometry: Geometry) -> FaultPatterns:
    """Positional faults for ``geometry``'s keys: per operation a gap / tail / random gaps (often none),
    maybe a run of failed calls (maybe endless: the store died), maybe scoped to one group or rank.
    (Few draws, each from a fixed list: this runs in many steps of the lifecycle fuzzer.)"""
    topology = geometry.topology
    exists, get, put = draw(_OP_PATTERNS), draw(_OP_PATTERNS), draw(_OP_PATTERNS)
    fail_after, fail_calls = draw(_FAILED_RUNS)
    scope = FaultScope(
        groups=draw(_scope_part(geometry.num_groups)),
        tp_ranks=draw(_scope_part(topology.tp_size)),
        dcp_ranks=draw(_scope_part(topology.dcp_size)),
    )
    return FaultPatterns(
        exists=exists,
        get=get,
        put=put,
        fail_after=fail_after,
        fail_calls=fail_calls,
        fail_ops=draw(_FAIL_OPS),
        scope=scope,
    )
