"""Load plans and their verdicts: which entries a hit fetches, and what a failed load means."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import EntryId, KeyScheme
from hybridkv.lifecycle.kinds import GroupKind, cdiv

__all__ = ["BlockLoad", "LoadOutcome", "LoadPlan", "LoadResolution", "retry_cap"]


@dataclass(frozen=True)
class BlockLoad:
    """One group block to fetch: ``block_index`` in the group's table, keyed at ``key_boundary``."""

    group_index: int
    block_index: int
    key_boundary: int
    block_hash: bytes


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

    @classmethod
    def from_status(cls, status: str) -> LoadOutcome:
        """The outcome of a worker's per-block store status (``hybridkv.store.Status`` value, or
        ``"not_attempted"``). Unknown statuses are transport errors: they never delete an entry."""
        return _STATUS_TO_OUTCOME.get(status, LoadOutcome.TRANSPORT_ERROR)


_STATUS_TO_OUTCOME: dict[str, LoadOutcome] = {
    "ok": LoadOutcome.OK,
    "not_found": LoadOutcome.MISSING,
    "corrupt": LoadOutcome.CORRUPT,
    "timeout": LoadOutcome.TIMEOUT,
    "transfer_failed": LoadOutcome.TRANSPORT_ERROR,
    "no_space": LoadOutcome.TRANSPORT_ERROR,
    "not_attempted": LoadOutcome.NOT_ATTEMPTED,
}


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
    def safe_boundary(self) -> int:
        """Deprecated name of ``retry_cap``."""
        return self.retry_cap

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
    loads: tuple[BlockLoad, ...]

    @cached_property
    def entries(self) -> tuple[tuple[EntryId, str], ...]:
        """Every (entry, key) of the plan, rank-major."""
        scheme = self.scheme
        return tuple(
            (
                EntryId(rank.tp_rank, load.group_index, load.block_index, load.key_boundary),
                scheme.key(load.group_index, rank.tp_rank, load.block_hash),
            )
            for rank in scheme.geometry.topology.ranks
            for load in self.loads
        )

    def loads_for_rank(self, tp_rank: int) -> list[tuple[BlockLoad, str]]:
        """The blocks ``tp_rank`` fetches, with their keys (possibly none: it must still report done)."""
        return [(load, self.scheme.key(load.group_index, tp_rank, load.block_hash)) for load in self.loads]

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

    ``failed``: the faulted entries of the plan (any rank, any ``LoadOutcome.is_fault``). With none, the cap is the planned boundary
    (aligned). Otherwise it is strictly below it, and no failed entry is needed to restore it:
    full attention block ``i`` bars boundaries ``> i * B_g``, a sliding-window block bars the boundaries
    whose window needs it, a Mamba state at ``b`` bars ``b``.
    """
    failed = tuple(failed)
    alignment = geometry.hit_alignment
    top = planned_boundary - 1 if failed else planned_boundary
    top = max(0, top - top % alignment)
    full_limit = top
    swa_failed: dict[int, set[int]] = {}
    mamba_failed: set[int] = set()
    for entry in failed:
        group = geometry.groups[entry.group_index]
        if group.kind is GroupKind.FULL:
            full_limit = min(full_limit, entry.block_index * geometry.spans[entry.group_index])
        elif group.kind is GroupKind.SLIDING_WINDOW:
            swa_failed.setdefault(entry.group_index, set()).add(entry.block_index)
        else:
            mamba_failed.add(entry.key_boundary)

    def swa_needs_failed(boundary: int) -> bool:
        # The blocks overlapping the window before the boundary (exactly the lookup's window blocks
        # when the boundary is a whole block; a superset otherwise).
        for g, blocks in swa_failed.items():
            group, span = geometry.groups[g], geometry.spans[g]
            assert group.sliding_window is not None
            window = max(1, cdiv(group.sliding_window - 1, span)) * span
            first, end = max(0, boundary - window) // span, cdiv(boundary, span)
            if any(first <= i < end for i in blocks):
                return True
        return False

    boundary = full_limit - full_limit % alignment
    while boundary > 0 and (boundary in mamba_failed or swa_needs_failed(boundary)):
        boundary -= alignment
    return boundary
