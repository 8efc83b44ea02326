"""Load plans and their verdicts: which entries a hit fetches, and what a failed load means.

``LoadPlan.resolve_outcomes(...) -> LoadResolution``: after per-(rank, group, block) outcomes, the retry
cap (the largest boundary no faulted entry of any group on any rank stands in the way of; the retry's
own lookup then finds what the store can still serve below it) and the keys to invalidate (definite
faults only: ``LoadOutcome.invalidates``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import EntryId, KeyScheme, PlannedBlock

__all__ = ["LoadOutcome", "LoadPlan", "LoadResolution", "retry_cap"]


class LoadOutcome(enum.Enum):
    """What happened to one planned entry of a load on one rank.

    Only a definite fault (``MISSING``: the store no longer has the key; ``CORRUPT``: its bytes failed
    the frame check) says the entry is bad: it ``invalidates`` (the block is removed on every rank).
    A ``TIMEOUT`` or ``TRANSPORT_ERROR`` says nothing about the entry (the store was slow, a transfer or
    staging buffer failed); ``NOT_ATTEMPTED`` entries were never read. Those keep their store entries:
    the fault is counted, the request recomputes, a later request may load them. Every fault (but not
    ``NOT_ATTEMPTED``) still bars the retry of THIS request from the boundaries that need the entry.
    """

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    TIMEOUT = "timeout"
    TRANSPORT_ERROR = "transport_error"
    NOT_ATTEMPTED = "not_attempted"

    @property
    def is_fault(self) -> bool:
        """The entry was read and did not load (bars the retry's boundaries that need it)."""
        return self is not LoadOutcome.OK and self is not LoadOutcome.NOT_ATTEMPTED

    @property
    def invalidates(self) -> bool:
        """The entry is known bad: remove it from the store (hard rule 3)."""
        return self is LoadOutcome.MISSING or self is LoadOutcome.CORRUPT


@dataclass(frozen=True)
class LoadResolution:
    """What a finished load means.

    ``verified``: every planned entry loaded ``OK`` on every rank (then ``retry_cap`` is the planned
    boundary and nothing is invalid).

    Otherwise the request is reported failed and vLLM (``kv_load_failure_policy="recompute"``) restarts
    it from ``num_computed_tokens = 0``, discarding whatever this load restored: the one retry reloads
    from scratch with a fresh lookup. So the verdict does not ask "what did this load restore" but "what
    may the retry use" and "what is known to be bad":

    - ``retry_cap``: the largest boundary the retry's lookup may return. It is the largest multiple of
      the hit alignment, at most ``planned_boundary - 1`` when some entry faulted (at most
      ``planned_boundary`` when entries were only not attempted), such that restoring it needs no
      faulted entry (any ``LoadOutcome.is_fault``, transient ones included) of any group on any rank:

      - full attention: a faulted block ``i`` of group ``g`` (on any rank: a DCP-sharded block that
        failed on one rank is bad for all) bars every boundary ``> i * B_g``;
      - sliding window: a faulted block bars the boundaries whose window needs it;
      - Mamba: a faulted state at ``b`` bars ``b`` only (states at other boundaries are other entries).

      The cap is only an upper bound: it says nothing about what the store still holds. The retry's
      ordinary lookup (one batched ``exists``) finds the best boundary ``<= retry_cap`` at which every
      group (e.g. a Mamba state saved at an earlier hand-off) exists on every rank. The cap is never
      below the local hit of the failed plan (failures are all past it). 0 = any boundary. Blocks past
      the cap (unattempted or faulted) are thereby unloadable for THIS request (hard rule 3).
    - ``invalid_entries`` / ``invalid_keys``: only definite faults (``LoadOutcome.invalidates``:
      ``MISSING``, ``CORRUPT``) are removed from the store, and with them the same block's entries on
      every other rank (a block is restorable only from every rank). Entries that timed out, hit a
      transport error or were not attempted stay: the store may serve them to a later request, whose
      frame check still guards every byte.
    - ``failed_entries``: every faulted entry (definite and transient), for the audit and counters.
    """

    verified: bool
    planned_boundary: int
    retry_cap: int
    invalid_keys: tuple[str, ...]
    failed_entries: tuple[EntryId, ...]
    invalid_entries: tuple[EntryId, ...] = ()

    @property
    def num_transient_faults(self) -> int:
        """Faulted entries that are not invalidated (timeouts, transport errors)."""
        return len(self.failed_entries) - len(self.invalid_entries)


@dataclass(frozen=True)
class LoadPlan:
    """Exactly which blocks of which group on which rank to fetch for one hit."""

    scheme: KeyScheme
    boundary: int
    num_computed_tokens: int
    loads: tuple[PlannedBlock, ...]

    @cached_property
    def entries(self) -> tuple[tuple[EntryId, str], ...]:
        """Every (entry, key) of the plan, rank-major."""
        return self.scheme.entries(self.loads)

    @cached_property
    def block_indexes_by_group(self) -> tuple[tuple[int, ...], ...]:
        """Per group index: the block-table positions of its planned blocks, in ``loads`` order.

        ``loads`` is sorted by (group, block index), so concatenating these rows gives ``loads``' order:
        binding the plan to a block table is one slice lookup per group (the scheduler's step does it)."""
        groups = [load.group_index for load in self.loads]
        assert groups == sorted(groups), f"plan for boundary {self.boundary}: loads are not grouped by group"
        rows: list[list[int]] = [[] for _ in range(self.scheme.geometry.num_groups)]
        for load in self.loads:
            rows[load.group_index].append(load.block_index)
        return tuple(tuple(row) for row in rows)

    def loads_for_rank(self, tp_rank: int) -> list[tuple[PlannedBlock, str]]:
        """The blocks ``tp_rank`` fetches, with their keys (possibly none: it must still report done)."""
        return self.scheme.rank_keys(self.loads, tp_rank)

    def group_num_blocks(self) -> tuple[int, ...]:
        counts = [0] * self.scheme.geometry.num_groups
        for load in self.loads:
            counts[load.group_index] += 1
        return tuple(counts)

    def resolve_outcomes(self, outcomes: Mapping[EntryId, LoadOutcome]) -> LoadResolution:
        """Judge a finished load (see ``LoadResolution``); entries missing from ``outcomes`` were not
        attempted."""
        ok = sum(1 for entry, _ in self.entries if outcomes.get(entry) is LoadOutcome.OK)
        if ok == len(self.entries):
            return LoadResolution(True, self.boundary, self.boundary, (), ())
        not_attempted = LoadOutcome.NOT_ATTEMPTED
        failed = tuple(entry for entry, _ in self.entries if outcomes.get(entry, not_attempted).is_fault)
        invalid = tuple(entry for entry, _ in self.entries if outcomes.get(entry, not_attempted).invalidates)
        cap = retry_cap(self.scheme.geometry, self.boundary, failed)
        # A bad block is removed on every rank (one rank's copy is useless without the others').
        bad_blocks = {(e.group_index, e.block_index, e.key_boundary) for e in invalid}
        invalid_keys = tuple(
            key
            for entry, key in self.entries
            if (entry.group_index, entry.block_index, entry.key_boundary) in bad_blocks
        )
        return LoadResolution(False, self.boundary, cap, invalid_keys, failed, invalid)


def retry_cap(geometry: Geometry, planned_boundary: int, failed: Iterable[EntryId]) -> int:
    """The largest aligned boundary the retry of a failed load may return (``LoadResolution.retry_cap``).

    ``failed``: the faulted entries of the plan (any rank, any ``LoadOutcome.is_fault``). With none, the
    cap is the planned boundary (aligned). Otherwise it is strictly below it, and no failed entry is
    needed to restore it (``KindRules.retry_boundary``): full attention block ``i`` bars boundaries
    ``> i * B_g``, a sliding-window block bars the boundaries whose window needs it, a Mamba state at
    ``b`` bars ``b``.
    """
    failed = tuple(failed)
    alignment = geometry.hit_alignment
    top = planned_boundary - 1 if failed else planned_boundary
    boundary = max(0, top - top % alignment)
    group_to_failed: dict[int, list[EntryId]] = {}
    for entry in failed:
        group_to_failed.setdefault(entry.group_index, []).append(entry)
    # Each group lowers the candidate to the largest aligned boundary it can restore without its
    # faulted entries; when none lowers it, every group can.
    while True:
        lowered = boundary
        for group_index, entries in group_to_failed.items():
            rules = geometry.groups[group_index].rules
            lowered = rules.retry_boundary(geometry, group_index, entries, lowered)
        if lowered == boundary:
            return boundary
        boundary = lowered
