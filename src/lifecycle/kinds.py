"""Cache kinds: the rules by which one prefix-cacheable KV-cache group is looked up, loaded, saved and
judged after a fault.

Every rule that differs between full attention, sliding window and Mamba lives here, in one rules
object per kind, found through ``KIND_RULES`` (like vLLM's spec -> single-type manager registry). The
geometry, the lookup, the load and save plans and the connector ask a group's rules
(``GroupSpec.rules``) instead of testing its kind; adding a kind is one ``KindRules`` subclass and one
table entry.

Token arithmetic, for ``B_full = 32``, ``h = 16``, ``B_mamba = 64``, a hit of ``H = 48`` tokens::

    tokens:      0        16       32       48       64
    full blocks: |----- 0 -------|----- 1 -------|        (block 1 keyed at its tail boundary >= 48)
    mamba:       |-------------- 0 --------------|        (state at exactly 48: block cdiv(48,64)-1 = 0)
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

if TYPE_CHECKING:
    from hybridkv.lifecycle.geometry import Geometry
    from hybridkv.lifecycle.keys import EntryId

__all__ = [
    "KIND_RULES",
    "FullAttentionRules",
    "GroupKind",
    "GroupSpec",
    "KindRules",
    "MambaRules",
    "SlidingWindowRules",
    "UnitHit",
    "cdiv",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class GroupKind(enum.Enum):
    """How a group's cache can be restored at a boundary (its rules: ``KIND_RULES[kind]``)."""

    #: Append-only KV (full attention, MLA): every block from the left.
    FULL = "full"
    #: Sliding-window KV: only the blocks of the window before the boundary.
    SLIDING_WINDOW = "swa"
    #: Mamba / linear-attention state ("align" mode): one state exactly at the boundary.
    MAMBA = "mamba"


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One prefix-cacheable KV-cache group.

    Args:
        kind: how the group is restored.
        block_size: tokens per block on one rank (vLLM ``spec.block_size``).
        dcp_sharded: whether DCP shards the group's tokens across ranks (attention: True, Mamba: False).
        sliding_window: the window in tokens (sliding window only).
        layout: opaque description of the bytes (dtype, heads, head size, MLA...). It enters the
            fingerprint, and groups with equal specs (layout included) are looked up together, as
            vLLM merges equal specs into one lookup.
    """

    kind: GroupKind
    block_size: int
    dcp_sharded: bool
    sliding_window: int | None = None
    layout: str = ""

    def __post_init__(self) -> None:
        assert self.block_size > 0, f"GroupSpec.block_size must be positive, got {self.block_size}"
        self.rules.validate(self)

    @property
    def rules(self) -> KindRules:
        """The rules of this group's kind."""
        return KIND_RULES[self.kind]

    @classmethod
    def full(cls, block_size: int, *, dcp_sharded: bool = True, layout: str = "") -> GroupSpec:
        return cls(kind=GroupKind.FULL, block_size=block_size, dcp_sharded=dcp_sharded, layout=layout)

    @classmethod
    def sliding_window_group(cls, block_size: int, sliding_window: int, *, layout: str = "") -> GroupSpec:
        return cls(
            kind=GroupKind.SLIDING_WINDOW,
            block_size=block_size,
            dcp_sharded=True,
            sliding_window=sliding_window,
            layout=layout,
        )

    @classmethod
    def mamba(cls, block_size: int, *, layout: str = "") -> GroupSpec:
        return cls(kind=GroupKind.MAMBA, block_size=block_size, dcp_sharded=False, layout=layout)

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "block_size": self.block_size,
            "dcp_sharded": self.dcp_sharded,
            "sliding_window": self.sliding_window,
            "layout": self.layout,
        }


class UnitHit(NamedTuple):
    """The largest boundary one lookup unit alone can restore (``KindRules.unit_hit``)."""

    hit: int
    #: Left-contiguous kinds only: the number of whole blocks found, and the boundary of the partial
    #: block (tail) found (0: none). The load plan keys the partial block by that boundary.
    num_full_blocks: int = 0
    tail_boundary: int = 0


#: Whether an entry of the unit ending at a boundary is available (on the device or in the store).
BoundaryAvailableFn = Callable[[int], bool]


class KindRules(abc.ABC):
    """What one cache kind means for lookups, loads, saves and retries.

    Methods take the deployment ``geometry`` and a ``group_index`` into ``geometry.groups`` (sizes such
    as the span ``B_g``, the hash unit and the hit alignment are geometry-wide). Stateless: one shared
    instance per kind.
    """

    kind: ClassVar[GroupKind]
    #: How messages name the kind.
    name: ClassVar[str]
    #: A hit at ``b`` implies every shorter boundary is restorable (append-only KV). Such units are
    #: looked up first and once per fixed point, then only trimmed (vLLM's full-attention rule).
    left_contiguous: ClassVar[bool] = False
    #: Blocks ending at or before the local hit are on the device already. False for a state restored
    #: at exactly one boundary: the local hit holds the state at the local hit only.
    covered_by_local_hit: ClassVar[bool] = True
    #: vLLM's manager for the kind probes hash boundaries inside a block (``supports_fine_grained_hash_lookup``).
    fine_grained_lookup: ClassVar[bool] = True
    #: vLLM's EAGLE lookup drops the last matched part of this kind's hit (a recurrent state's never does).
    eagle_drops: ClassVar[bool] = True
    #: vLLM runs the kind under decode context parallelism (DCP > 1).
    supports_dcp: ClassVar[bool] = True
    #: Blocks are saved as the request's positions fill them. False: entries are saved only at the
    #: hand-off boundaries vLLM reports (Mamba states).
    positional_saves: ClassVar[bool] = True
    #: A group of this kind is exact under vLLM's divergent local hits, where the local hit is the
    #: full-attention group's and other groups may lag behind it locally: full attention (the hit is its
    #: own) and a recurrent state (restored from the store at the loaded boundary, never reused from the
    #: local hit) are; a sliding window is not (a lagging window needs blocks below the local hit, which
    #: no load writes).
    exact_under_divergent_local_hits: ClassVar[bool] = True
    #: A block may be stored under an interior hash boundary (a prompt tail) while later steps still
    #: append to it: a save snapshots it, and a state saved inside such a block needs its tail saved.
    stores_partial_tails: ClassVar[bool] = False

    def validate(self, spec: GroupSpec) -> None:
        """Assert that ``spec`` is a valid group of this kind."""
        assert spec.sliding_window is None, f"only sliding-window groups have a window: {spec}"

    def enables_fine_hits(self, spec: GroupSpec, hash_unit: int, dcp_size: int) -> bool:
        """This group turns on vLLM's fine-grained ("partial hash") hits."""
        return False

    def permits_fine_hits(self, span: int, hash_unit: int) -> bool:
        """Fine-grained hits remain possible with this group in the layout."""
        return True

    def candidate_boundaries(
        self, geometry: Geometry, group_index: int, local: int, cap: int
    ) -> Sequence[int]:
        """The boundaries in ``(local, cap]`` at which a lookup may ask for an entry, ascending."""
        # Fine groups: every hash boundary may hold a full-attention tail or a Mamba state.
        step = geometry.hash_unit if geometry.is_fine_span[group_index] else geometry.spans[group_index]
        return range((local // step + 1) * step, cap + 1, step)

    @abc.abstractmethod
    def unit_hit(
        self,
        geometry: Geometry,
        unit: tuple[int, ...],
        cap: int,
        available: BoundaryAvailableFn,
        *,
        drop: bool = False,
    ) -> UnitHit:
        """The largest boundary ``<= cap`` that the lookup ``unit`` (groups of equal spec) alone can
        restore, by vLLM's rules for the kind. ``drop``: vLLM's EAGLE lookup (``Geometry.eagle``), which
        matches past the boundary it reports and drops that part (the caller widens ``cap`` by
        :meth:`eagle_margin` first)."""

    def eagle_margin(self, geometry: Geometry, unit: tuple[int, ...]) -> int:
        """Tokens an EAGLE lookup of ``unit`` matches past the candidate before dropping them (vLLM's
        ``eagle_proof_margin``): one hash unit where the kind looks up fine-grained, else one block."""
        span = geometry.spans[unit[0]]
        if geometry.fine_grained and self.fine_grained_lookup and span > geometry.hash_unit:
            return geometry.hash_unit
        return span

    @abc.abstractmethod
    def blocks_to_load(
        self, geometry: Geometry, group_index: int, boundary: int, local: int, found: UnitHit
    ) -> Iterator[tuple[int, int]]:
        """``(block_index, key_boundary)`` of every entry restoring ``boundary`` past the local hit.

        ``found``: the group's unit hit from the fixed point (meaningful for left-contiguous kinds).
        """

    @abc.abstractmethod
    def retry_boundary(
        self, geometry: Geometry, group_index: int, failed: Sequence[EntryId], boundary: int
    ) -> int:
        """The largest multiple of the hit alignment ``<= boundary`` (itself aligned) whose restore
        needs none of this group's ``failed`` entries."""

    def check_save_boundary(  # noqa: B027 -- an optional hook: the default (no constraint) checks nothing
        self, geometry: Geometry, group_index: int, boundary: int
    ) -> None:
        """Assert that an entry of this group may be saved ending at ``boundary`` (a hash boundary); the
        default checks nothing (a kind whose entries may end at any hash boundary keeps it)."""

    def step_back_boundaries(
        self,
        geometry: Geometry,
        group_index: int,
        boundary: int,
        candidates: Sequence[int],
        probed: Callable[[int], bool],
        max_states: int,
    ) -> list[int]:
        """Candidate boundaries below ``boundary`` (probed present) whose entries a short step back
        from ``boundary`` needs; a lookup confirms them with the plan of ``boundary``."""
        return []


class FullAttentionRules(KindRules):
    """Append-only KV (full attention, MLA): a boundary needs every block from the left."""

    kind = GroupKind.FULL
    name = "full attention"
    left_contiguous = True
    stores_partial_tails = True

    def unit_hit(
        self,
        geometry: Geometry,
        unit: tuple[int, ...],
        cap: int,
        available: BoundaryAvailableFn,
        *,
        drop: bool = False,
    ) -> UnitHit:
        span = geometry.spans[unit[0]]
        alignment = geometry.hit_alignment
        num_blocks = 0
        while (num_blocks + 1) * span <= cap and available((num_blocks + 1) * span):
            num_blocks += 1
        hit = num_blocks * span
        tail_boundary = 0
        if geometry.is_fine_span[unit[0]]:
            # Probe the interior hash boundaries of the first missing block, longest first.
            top = min(num_blocks * span + span - alignment, cap - cap % alignment)
            for boundary in range(top, num_blocks * span, -alignment):
                if available(boundary):
                    hit = tail_boundary = boundary
                    break
        if drop and hit > 0:
            # EAGLE: one hash unit (fine-grained; the tail block's KV still covers the shorter hit) or
            # one block fewer.
            hit -= min(alignment, span)
        hit -= hit % alignment
        return UnitHit(hit, num_blocks, tail_boundary)

    def blocks_to_load(
        self, geometry: Geometry, group_index: int, boundary: int, local: int, found: UnitHit
    ) -> Iterator[tuple[int, int]]:
        span = geometry.spans[group_index]
        for i in range(local // span, cdiv(boundary, span)):
            if i < found.num_full_blocks:
                yield i, (i + 1) * span
            else:
                # The partial block: addressed by the boundary it was stored under.
                assert i == found.num_full_blocks and found.tail_boundary >= boundary, (
                    f"group {group_index}: block {i} of a {boundary}-token hit has no entry covering it "
                    f"(tail at {found.tail_boundary}); the fixed point is inconsistent"
                )
                yield i, found.tail_boundary

    def retry_boundary(
        self, geometry: Geometry, group_index: int, failed: Sequence[EntryId], boundary: int
    ) -> int:
        # A faulted block i (on any rank: a DCP-sharded block that failed on one rank is bad for all)
        # bars every boundary > i * B_g.
        span = geometry.spans[group_index]
        limit = min(boundary, *(entry.block_index * span for entry in failed))
        return limit - limit % geometry.hit_alignment


class SlidingWindowRules(KindRules):
    """Sliding-window KV: a boundary needs the blocks of the window before it; whole blocks only."""

    kind = GroupKind.SLIDING_WINDOW
    name = "sliding window"
    # vLLM: DCP > 1 with hybrid layouts allows only full attention (incl. MLA) and Mamba.
    supports_dcp = False
    fine_grained_lookup = False
    exact_under_divergent_local_hits = False

    def validate(self, spec: GroupSpec) -> None:
        assert spec.sliding_window is not None and spec.sliding_window > 0, (
            f"a sliding-window GroupSpec needs sliding_window > 0, got {spec.sliding_window}"
        )

    def permits_fine_hits(self, span: int, hash_unit: int) -> bool:
        # Sliding-window lookups are block-granular; they only allow fine hits at span == unit.
        return span == hash_unit

    def candidate_boundaries(
        self, geometry: Geometry, group_index: int, local: int, cap: int
    ) -> Sequence[int]:
        span = geometry.spans[group_index]
        return range((local // span + 1) * span, cap + 1, span)

    @staticmethod
    def num_window_blocks(spec: GroupSpec, span: int) -> int:
        """Blocks of the window before a block boundary (at least one)."""
        assert spec.sliding_window is not None, f"not a sliding-window group: {spec}"
        return max(1, cdiv(spec.sliding_window - 1, span))

    def unit_hit(
        self,
        geometry: Geometry,
        unit: tuple[int, ...],
        cap: int,
        available: BoundaryAvailableFn,
        *,
        drop: bool = False,
    ) -> UnitHit:
        span = geometry.spans[unit[0]]
        alignment = geometry.hit_alignment
        num_needed = self.num_window_blocks(geometry.groups[unit[0]], span)
        if drop:
            window = geometry.groups[unit[0]].sliding_window
            assert window is not None, f"group {unit[0]}: a sliding-window group without a window"
            # vLLM's count: cdiv(window - 1, span) blocks, one more for the drop (0 + 1 for a 1-token window).
            return self._eagle_unit_hit(span, alignment, cdiv(window - 1, span) + 1, cap, available)
        num_blocks = cap // span
        # run[i]: consecutive available blocks ending at block i.
        run = 0
        runs = []
        for i in range(num_blocks):
            run = run + 1 if available((i + 1) * span) else 0
            runs.append(run)
        for i in range(num_blocks - 1, -1, -1):
            boundary = (i + 1) * span
            if boundary % alignment == 0 and runs[i] >= min(num_needed, i + 1):
                return UnitHit(boundary)
        return UnitHit(0)

    @staticmethod
    def _eagle_unit_hit(
        span: int, alignment: int, num_needed: int, cap: int, available: BoundaryAvailableFn
    ) -> UnitHit:
        """vLLM's EAGLE window lookup: one block more than the window, scanned from the right (a run's
        last block must end on the alignment once the drop took it), then that block dropped and the hit
        aligned down."""
        num_blocks = run = 0
        found = False
        for i in range(cap // span - 1, -1, -1):
            if not available((i + 1) * span):
                run = 0
                continue
            if run == 0 and span != alignment and (i * span) % alignment:
                continue
            run += 1
            if run >= num_needed:
                num_blocks, found = i + run, True
                break
        if not found:
            num_blocks = run
            while span != alignment and num_blocks * span % alignment:
                num_blocks -= 1
        if num_blocks:
            num_blocks -= 1
            while span != alignment and num_blocks * span % alignment:
                num_blocks -= 1
        return UnitHit(num_blocks * span)

    def blocks_to_load(
        self, geometry: Geometry, group_index: int, boundary: int, local: int, found: UnitHit
    ) -> Iterator[tuple[int, int]]:
        span = geometry.spans[group_index]
        end = boundary // span
        num_blocks = self.num_window_blocks(geometry.groups[group_index], span)
        window = geometry.groups[group_index].sliding_window
        if geometry.group_drops(group_index) and window is not None:
            # The window blocks vLLM's EAGLE lookup verified before the boundary (none for a 1-token window:
            # its one matched block is the dropped one past the boundary).
            num_blocks = cdiv(window - 1, span)
        for i in range(max(0, end - num_blocks), end):
            if (i + 1) * span > local:
                yield i, (i + 1) * span

    def retry_boundary(
        self, geometry: Geometry, group_index: int, failed: Sequence[EntryId], boundary: int
    ) -> int:
        # The blocks overlapping the window before the boundary (exactly the lookup's window blocks
        # when the boundary is a whole block; a superset otherwise).
        span = geometry.spans[group_index]
        window = self.num_window_blocks(geometry.groups[group_index], span) * span
        blocks = {entry.block_index for entry in failed}
        alignment = geometry.hit_alignment

        def needs_failed(b: int) -> bool:
            first, end = max(0, b - window) // span, cdiv(b, span)
            return any(first <= i < end for i in blocks)

        while boundary > 0 and needs_failed(boundary):
            boundary -= alignment
        return boundary

    def check_save_boundary(self, geometry: Geometry, group_index: int, boundary: int) -> None:
        assert boundary % geometry.spans[group_index] == 0, (
            f"group {group_index}: sliding-window saves are whole blocks"
        )

    def step_back_boundaries(
        self,
        geometry: Geometry,
        group_index: int,
        boundary: int,
        candidates: Sequence[int],
        probed: Callable[[int], bool],
        max_states: int,
    ) -> list[int]:
        # The windows of the last ``max_states`` block boundaries below.
        spec, span = geometry.groups[group_index], geometry.spans[group_index]
        assert spec.sliding_window is not None
        reach = (max_states + cdiv(spec.sliding_window - 1, span) + 1) * span
        return [b for b in candidates if boundary - reach <= b < boundary and probed(b)]


class MambaRules(KindRules):
    """Mamba / linear-attention state ("align" mode): a boundary needs one state, exactly there."""

    kind = GroupKind.MAMBA
    name = "Mamba"
    covered_by_local_hit = False
    eagle_drops = False
    positional_saves = False

    def validate(self, spec: GroupSpec) -> None:
        super().validate(spec)
        assert not spec.dcp_sharded, "Mamba state is replicated across DCP ranks, never sharded"

    def enables_fine_hits(self, spec: GroupSpec, hash_unit: int, dcp_size: int) -> bool:
        if dcp_size == 1:
            return spec.block_size > hash_unit
        return spec.block_size >= hash_unit

    def candidate_boundaries(
        self, geometry: Geometry, group_index: int, local: int, cap: int
    ) -> Sequence[int]:
        boundaries = super().candidate_boundaries(geometry, group_index, local, cap)
        if geometry.is_fine_span[group_index]:
            return boundaries
        # vLLM skips Mamba states off the hit alignment.
        return [b for b in boundaries if b % geometry.hit_alignment == 0]

    def unit_hit(
        self,
        geometry: Geometry,
        unit: tuple[int, ...],
        cap: int,
        available: BoundaryAvailableFn,
        *,
        drop: bool = False,
    ) -> UnitHit:
        # ``drop`` changes nothing: vLLM's Mamba lookup never drops (drafters have no Mamba layers).
        alignment = geometry.hit_alignment
        fine = geometry.is_fine_span[unit[0]]
        step = geometry.hash_unit if fine else geometry.spans[unit[0]]
        for boundary in range(cap - cap % step, 0, -step):
            if not fine and boundary % alignment:
                continue
            if available(boundary):
                return UnitHit(boundary)
        return UnitHit(0)

    def blocks_to_load(
        self, geometry: Geometry, group_index: int, boundary: int, local: int, found: UnitHit
    ) -> Iterator[tuple[int, int]]:
        # One state, exactly at the boundary, in block cdiv(H, B) - 1.
        yield cdiv(boundary, geometry.spans[group_index]) - 1, boundary

    def retry_boundary(
        self, geometry: Geometry, group_index: int, failed: Sequence[EntryId], boundary: int
    ) -> int:
        # A faulted state at b bars b only (states at other boundaries are other entries).
        barred = {entry.key_boundary for entry in failed}
        while boundary > 0 and boundary in barred:
            boundary -= geometry.hit_alignment
        return boundary

    def step_back_boundaries(
        self,
        geometry: Geometry,
        group_index: int,
        boundary: int,
        candidates: Sequence[int],
        probed: Callable[[int], bool],
        max_states: int,
    ) -> list[int]:
        # The nearest probed states (states are saved at a few hand-off boundaries only); the scan stops
        # at the last one it needs (a 128K prompt has thousands of candidates below the boundary).
        found: list[int] = []
        for b in reversed(candidates):
            if len(found) == max_states:
                break
            if b < boundary and probed(b):
                found.append(b)
        return found


#: The rules of every cache kind.
KIND_RULES: dict[GroupKind, KindRules] = {
    rules.kind: rules for rules in (FullAttentionRules(), SlidingWindowRules(), MambaRules())
}
assert set(KIND_RULES) == set(GroupKind), f"kinds without rules: {set(GroupKind) - set(KIND_RULES)}"
