"""Cache geometry: group specs, store keys, the agreed boundary, load plans and truncation.

Pure arithmetic over plain ints, lists and bytes (no vLLM, no torch), so the scheduler half and the
worker half of the connector compute the same answers from the same inputs.

Primitives and their contracts:

- ``GroupSpec`` / ``Topology`` / ``Geometry``: the prefix-cacheable KV-cache groups (in vLLM's
  ``prefix_cacheable_group_ids`` order; the store group index is the position in ``Geometry.groups``),
  their effective spans ``B_g = block_size * (dcp if dcp_sharded else 1)``, the scheduler block
  (lcm of spans), the hash unit ``h`` (gcd, or a prefix-match unit dividing every span) and the hit
  alignment vLLM uses (``h`` when fine-grained "partial hash hits" are on, else the scheduler block).
- ``KeyScheme``: the store key of one group block on one rank. The block (or fine-grained tail) that
  ends at token ``t`` is keyed by ``block_hashes[t // h - 1]`` (vLLM: a coarse block's hash is its
  last fine hash). A tail is always addressed by the boundary it was stored under; a shorter boundary
  is never derived from a longer key.
- ``plan_lookup(...) -> LookupCandidates``: every key one lookup may need, for ONE ``store.exists``.
- ``LookupCandidates.resolve(exists) -> LookupResult``: the agreed boundary (the same fixed point as
  vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``) and the exact ``LoadPlan``.
- ``LoadPlan.resolve_outcomes(...) -> LoadResolution``: after per-(rank, group, block) outcomes, the
  retry cap (the largest boundary no faulted entry of any group on any rank stands in the way of; the
  retry's own lookup then finds what the store can still serve below it) and the keys to invalidate
  (definite faults only: ``LoadOutcome.invalidates``).
- ``plan_save(...) -> SavePlan``: the keys of the blocks a save wave writes, and which blocks count
  as stored (every rank OK) so that events are published only for stored entries.

Token arithmetic, for ``B_full = 32``, ``h = 16``, ``B_mamba = 64``, a hit of ``H = 48`` tokens::

    tokens:      0        16       32       48       64
    full blocks: |----- 0 -------|----- 1 -------|        (block 1 keyed at its tail boundary >= 48)
    mamba:       |-------------- 0 --------------|        (state at exactly 48: block cdiv(48,64)-1 = 0)
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

__all__ = [
    "BlockLoad",
    "EntryId",
    "Geometry",
    "GroupKind",
    "GroupSpec",
    "KeyScheme",
    "LoadOutcome",
    "LoadPlan",
    "LoadResolution",
    "LookupCandidates",
    "LookupResult",
    "Rank",
    "SaveBlock",
    "SavePlan",
    "Topology",
    "cdiv",
    "plan_lookup",
    "plan_save",
    "retry_cap",
]

KEY_VERSION = "hkv1"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class GroupKind(enum.Enum):
    """How a group's cache can be restored at a boundary."""

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
        if self.kind is GroupKind.SLIDING_WINDOW:
            assert self.sliding_window is not None and self.sliding_window > 0, (
                f"a sliding-window GroupSpec needs sliding_window > 0, got {self.sliding_window}"
            )
        else:
            assert self.sliding_window is None, f"only sliding-window groups have a window: {self}"
        if self.kind is GroupKind.MAMBA:
            assert not self.dcp_sharded, "Mamba state is replicated across DCP ranks, never sharded"

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


class Rank(NamedTuple):
    """One worker rank. Without PCP, DCP groups are consecutive TP ranks: ``dcp_rank = tp_rank % dcp``."""

    tp_rank: int
    dcp_rank: int


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Parallel layout that changes which bytes a rank holds."""

    tp_size: int = 1
    dcp_size: int = 1
    #: ``cp_kv_cache_interleave_size``: tokens per DCP rank before moving to the next.
    interleave: int = 1

    def __post_init__(self) -> None:
        assert self.tp_size >= 1 and self.dcp_size >= 1 and self.interleave >= 1, f"bad topology {self}"
        assert self.tp_size % self.dcp_size == 0, (
            f"DCP reuses TP ranks: tp_size={self.tp_size} must be a multiple of dcp_size={self.dcp_size}"
        )

    @cached_property
    def ranks(self) -> tuple[Rank, ...]:
        return tuple(Rank(tp_rank, tp_rank % self.dcp_size) for tp_rank in range(self.tp_size))


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """The prefix-cacheable groups of one deployment, and the sizes vLLM derives from them.

    Args:
        groups: prefix-cacheable groups in vLLM order; the store group index is the position here.
        topology: TP/DCP sizes and interleave.
        prefix_match_unit: vLLM ``--prefix-match-unit`` (None: gcd of the spans).
        other_group_spans: effective spans of KV-cache groups that are not prefix-cacheable; they only
            widen the scheduler block (lcm) and make the layout hybrid.
    """

    groups: tuple[GroupSpec, ...]
    topology: Topology = field(default_factory=Topology)
    prefix_match_unit: int | None = None
    other_group_spans: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.groups, "a Geometry needs at least one prefix-cacheable group"
        dcp = self.topology.dcp_size
        for index, group in enumerate(self.groups):
            if dcp > 1:
                # vLLM: DCP>1 with hybrid layouts allows only full attention (incl. MLA) and Mamba.
                assert group.kind is not GroupKind.SLIDING_WINDOW, (
                    f"group {index}: sliding window is not supported under DCP={dcp}"
                )
            if group.dcp_sharded and dcp > 1:
                assert group.block_size % self.topology.interleave == 0, (
                    f"group {index}: block_size {group.block_size} is not a multiple of the DCP "
                    f"interleave {self.topology.interleave}"
                )
        spans = self.spans
        if self.is_single_group:
            assert self.prefix_match_unit in (None, spans[0]), (
                f"single-group layouts hash at the block span {spans[0]}; "
                f"prefix_match_unit={self.prefix_match_unit} is invalid"
            )
        unit = self.hash_unit
        assert all(span % unit == 0 for span in spans), (
            f"every group span {spans} must be divisible by the hash unit {unit}"
        )

    # -- sizes --------------------------------------------------------------------------------------

    @cached_property
    def spans(self) -> tuple[int, ...]:
        """Effective token span ``B_g`` of one block of each group (all DCP ranks together)."""
        dcp = self.topology.dcp_size
        return tuple(g.block_size * (dcp if g.dcp_sharded else 1) for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_single_group(self) -> bool:
        return len(self.groups) == 1 and not self.other_group_spans

    @cached_property
    def scheduler_block_size(self) -> int:
        """The lcm of every group's span: the granularity of ``num_computed_tokens``."""
        return math.lcm(*self.spans, *self.other_group_spans)

    @cached_property
    def hash_unit(self) -> int:
        """Tokens per entry of ``request.block_hashes``."""
        if self.is_single_group:
            return self.spans[0]
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        return math.gcd(*self.spans)

    @cached_property
    def fine_grained(self) -> bool:
        """vLLM ``partial_hash_hits_enabled``: hits may land on any hash boundary."""
        if self.is_single_group:
            return False
        unit = self.hash_unit
        dcp = self.topology.dcp_size
        has_fine_mamba = any(
            g.kind is GroupKind.MAMBA
            and ((dcp == 1 and g.block_size > unit) or (dcp > 1 and g.block_size >= unit))
            for g in self.groups
        )
        # Sliding-window lookups are block-granular; they only allow fine hits at span == unit.
        block_granular_ok = all(
            span == unit for g, span in zip(self.groups, self.spans) if g.kind is GroupKind.SLIDING_WINDOW
        )
        return has_fine_mamba and block_granular_ok

    @cached_property
    def hit_alignment(self) -> int:
        """Every hit vLLM reports is a multiple of this many tokens."""
        if self.is_single_group:
            return self.spans[0]
        return self.hash_unit if self.fine_grained else self.scheduler_block_size

    @cached_property
    def is_fine_span(self) -> tuple[bool, ...]:
        """Per group: hits may land inside one of its blocks (the hit alignment is finer than its span)."""
        alignment = self.hit_alignment
        return tuple(alignment < span and span % alignment == 0 for span in self.spans)

    @cached_property
    def lookup_units(self) -> tuple[tuple[int, ...], ...]:
        """Groups looked up together, in vLLM's order: equal specs merged, full attention first."""
        units: list[list[int]] = []
        for index, group in enumerate(self.groups):
            for unit in units:
                if self.groups[unit[0]] == group:
                    unit.append(index)
                    break
            else:
                units.append([index])
        units.sort(key=lambda unit: self.groups[unit[0]].kind is not GroupKind.FULL)
        return tuple(tuple(unit) for unit in units)

    def describe(self) -> dict[str, object]:
        return {
            "groups": [g.describe() for g in self.groups],
            "spans": list(self.spans),
            "tp_size": self.topology.tp_size,
            "dcp_size": self.topology.dcp_size,
            "interleave": self.topology.interleave,
            "hash_unit": self.hash_unit,
            "scheduler_block_size": self.scheduler_block_size,
            "hit_alignment": self.hit_alignment,
            "other_group_spans": list(self.other_group_spans),
        }


@dataclass(frozen=True, kw_only=True)
class KeyScheme:
    """Store keys: ``hkv1/<namespace>/<fingerprint>/g<group>/tp<r>/dcp<r>/<hash hex>``.

    ``prefix`` removes every entry of a deployment (namespace); ``geometry_prefix`` every entry of one
    geometry. The fingerprint covers the model's identity, dtypes, layout, hash algorithm, every group
    spec, sizes, hash unit, TP/DCP sizes and interleave, so incompatible deployments never read each
    other's bytes.

    ``model_identity`` is what identifies the weights and model options (``hybridkv.connector.identity``:
    weight files, revision, quantization, overrides, RoPE scaling); when set, it replaces ``model`` (a
    display name) in the fingerprint, so the same weights in two folders share entries and two models
    in folders of one name do not.
    """

    namespace: str
    model: str
    geometry: Geometry
    kv_cache_dtype: str = "auto"
    kv_cache_layout: str = ""
    hash_algorithm: str = "sha256"
    model_identity: str = ""

    def __post_init__(self) -> None:
        assert _NAMESPACE_RE.match(self.namespace), (
            f"namespace {self.namespace!r} must match {_NAMESPACE_RE.pattern} (it becomes a key path segment)"
        )

    @cached_property
    def fingerprint(self) -> str:
        payload = {
            "version": KEY_VERSION,
            "model": self.model_identity or self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_cache_layout": self.kv_cache_layout,
            "hash_algorithm": self.hash_algorithm,
            "geometry": self.geometry.describe(),
        }
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    @cached_property
    def prefix(self) -> str:
        return f"{KEY_VERSION}/{self.namespace}/"

    @cached_property
    def geometry_prefix(self) -> str:
        return f"{self.prefix}{self.fingerprint}/"

    @cached_property
    def _group_rank_prefixes(self) -> tuple[tuple[str, ...], ...]:
        base = self.geometry_prefix
        return tuple(
            tuple(f"{base}g{g}/tp{r.tp_rank}/dcp{r.dcp_rank}/" for r in self.geometry.topology.ranks)
            for g in range(self.geometry.num_groups)
        )

    def key(self, group_index: int, tp_rank: int, block_hash: bytes) -> str:
        """The key of the entry of ``group_index`` on ``tp_rank`` whose boundary hash is ``block_hash``."""
        return self._group_rank_prefixes[group_index][tp_rank] + block_hash.hex()

    def boundary_hash(self, block_hashes: Sequence[bytes], boundary_tokens: int) -> bytes:
        """The hash that keys an entry ending at ``boundary_tokens`` (a multiple of the hash unit)."""
        unit = self.geometry.hash_unit
        assert boundary_tokens > 0 and boundary_tokens % unit == 0, (
            f"boundary {boundary_tokens} is not a positive multiple of the hash unit {unit}"
        )
        return block_hashes[boundary_tokens // unit - 1]


# -- lookup ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockLoad:
    """One group block to fetch: ``block_index`` in the group's table, keyed at ``key_boundary``."""

    group_index: int
    block_index: int
    key_boundary: int
    block_hash: bytes


class EntryId(NamedTuple):
    """One stored entry of a plan: a group block on a rank, stored under ``key_boundary``.

    The boundary is part of the identity: one block may hold several entries (a whole block and a
    prompt tail, or Mamba states at several hash boundaries of one block).
    """

    tp_rank: int
    group_index: int
    block_index: int
    key_boundary: int


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


AvailableFn = Callable[[int, int], bool]
UnitAvailableFn = Callable[[tuple[int, ...], int], bool]


@dataclass(frozen=True)
class LookupResult:
    """The answer to one lookup.

    ``boundary`` is the agreed token count (<= ``num_computed_tokens`` means no external hit);
    ``num_external_tokens = max(0, boundary - num_computed_tokens)`` is what the connector reports.
    ``group_hit_tokens[g]`` is what group ``g`` alone could restore: audit detail only, so it is
    computed on first access, not on the scheduler's lookup path.
    """

    boundary: int
    num_tokens: int
    num_computed_tokens: int
    plan: LoadPlan | None
    _geometry: Geometry = field(repr=False, compare=False)
    _cap: int = field(repr=False, compare=False)
    _unit_available: UnitAvailableFn = field(repr=False, compare=False)

    @cached_property
    def group_hit_tokens(self) -> tuple[int, ...]:
        hits = [0] * self._geometry.num_groups
        for unit in self._geometry.lookup_units:
            independent = _unit_hit(self._geometry, unit, self._cap, self._unit_available).hit
            for g in unit:
                hits[g] = independent
        return tuple(hits)

    @property
    def num_external_tokens(self) -> int:
        return max(0, self.boundary - self.num_computed_tokens)

    @property
    def is_hit(self) -> bool:
        return self.plan is not None


@dataclass(frozen=True)
class LookupCandidates:
    """Every key one lookup may need, in one batch: pass ``keys`` to ``store.exists`` once.

    Build with ``plan_lookup``; then ``resolve(exists)`` with one bool per key, in order.
    """

    scheme: KeyScheme
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    num_computed_tokens: int
    max_boundary: int
    keys: tuple[str, ...]
    #: (group_index, boundary) -> index of its first key; one key per rank follows.
    group_boundary_to_index: Mapping[tuple[int, int], int]

    def resolve(self, exists: Sequence[bool]) -> LookupResult:
        """The agreed boundary and load plan, given one existence result per key (errors: False)."""
        assert len(exists) == len(self.keys), (
            f"exists() returned {len(exists)} results for {len(self.keys)} keys; this is a connector bug"
        )
        num_ranks = len(self.scheme.geometry.topology.ranks)
        index_of = self.group_boundary_to_index

        def available_in_store(group_index: int, boundary: int) -> bool:
            start = index_of.get((group_index, boundary))
            if start is None:
                return False
            return all(exists[start : start + num_ranks])

        return _resolve(self, available_in_store)


def plan_lookup(
    scheme: KeyScheme,
    block_hashes: Sequence[bytes],
    num_tokens: int,
    num_computed_tokens: int = 0,
    *,
    max_boundary: int | None = None,
) -> LookupCandidates:
    """List every key the lookup of one request may need.

    Args:
        scheme: the deployment's key scheme.
        block_hashes: ``request.block_hashes`` (one per hash unit, full units only).
        num_tokens: ``request.num_tokens``; at least one token is always left to recompute.
        num_computed_tokens: the local hit vLLM passes (a multiple of the scheduler block; a value
            that is not is floored for planning, but a hit must still exceed the value given).
        max_boundary: an extra cap (after a truncation: the truncated boundary).
    """
    geometry = scheme.geometry
    unit = geometry.hash_unit
    alignment = geometry.hit_alignment
    cap = min(num_tokens - 1, len(block_hashes) * unit)
    if max_boundary is not None:
        cap = min(cap, max_boundary)
    cap = max(cap, 0)
    local = num_computed_tokens - num_computed_tokens % geometry.scheduler_block_size
    hashes = tuple(block_hashes)
    keys: list[str] = []
    index_of: dict[tuple[int, int], int] = {}
    for group_index, (group, span) in enumerate(zip(geometry.groups, geometry.spans)):
        fine = geometry.is_fine_span[group_index]
        # Fine groups: every hash boundary may hold a full-attention tail or a Mamba state.
        step = unit if fine and group.kind is not GroupKind.SLIDING_WINDOW else span
        rank_prefixes = scheme._group_rank_prefixes[group_index]
        first = (local // step + 1) * step
        for boundary in range(first, cap + 1, step):
            if group.kind is GroupKind.MAMBA and not fine and boundary % alignment:
                continue  # vLLM skips Mamba states off the hit alignment
            index_of[(group_index, boundary)] = len(keys)
            hash_hex = hashes[boundary // unit - 1].hex()
            keys.extend([prefix + hash_hex for prefix in rank_prefixes])
    return LookupCandidates(
        scheme=scheme,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=num_computed_tokens,
        max_boundary=cap,
        keys=tuple(keys),
        group_boundary_to_index=index_of,
    )


class _UnitHit(NamedTuple):
    hit: int
    #: FULL only: the number of whole blocks found, and the boundary of the tail found (0: none).
    num_full_blocks: int = 0
    tail_boundary: int = 0


def _resolve(candidates: LookupCandidates, available_in_store: AvailableFn) -> LookupResult:
    geometry = candidates.scheme.geometry
    local = candidates.num_computed_tokens - candidates.num_computed_tokens % geometry.scheduler_block_size
    cap = candidates.max_boundary

    def available(group_index: int, boundary: int) -> bool:
        # Blocks ending at or before the local hit are on the device already (vLLM agreed on `local`).
        kind = geometry.groups[group_index].kind
        if boundary <= local and kind is not GroupKind.MAMBA:
            return True
        return available_in_store(group_index, boundary)

    def unit_available(unit: tuple[int, ...], boundary: int) -> bool:
        return all(available(g, boundary) for g in unit)

    boundary, full_hits = _fixed_point(geometry, cap, unit_available)
    plan = None
    if boundary > candidates.num_computed_tokens:
        plan = _build_plan(candidates, boundary, local, full_hits)
    return LookupResult(
        boundary=boundary,
        num_tokens=candidates.num_tokens,
        num_computed_tokens=candidates.num_computed_tokens,
        plan=plan,
        _geometry=geometry,
        _cap=cap,
        _unit_available=unit_available,
    )


def _fixed_point(
    geometry: Geometry, cap: int, unit_available: UnitAvailableFn
) -> tuple[int, dict[tuple[int, ...], _UnitHit]]:
    """vLLM's hybrid fixed point: each unit may only shrink the candidate; full attention is looked up
    once (at the candidate of its first visit) and then only trimmed."""
    hit = cap
    full_hits: dict[tuple[int, ...], _UnitHit] = {}
    while True:
        current = hit
        for unit in geometry.lookup_units:
            if geometry.groups[unit[0]].kind is GroupKind.FULL:
                if unit in full_hits:
                    current = min(current, full_hits[unit].hit)
                    continue
                full_hits[unit] = _unit_hit(geometry, unit, current, unit_available)
                current = full_hits[unit].hit
            else:
                current = _unit_hit(geometry, unit, current, unit_available).hit
        if current >= hit:
            return hit, full_hits
        hit = current


def _unit_hit(
    geometry: Geometry, unit: tuple[int, ...], cap: int, unit_available: UnitAvailableFn
) -> _UnitHit:
    """The largest boundary <= ``cap`` that ``unit`` alone can restore, by vLLM's per-kind rules."""
    group = geometry.groups[unit[0]]
    span = geometry.spans[unit[0]]
    alignment = geometry.hit_alignment
    hash_unit = geometry.hash_unit
    fine = geometry.is_fine_span[unit[0]]
    if group.kind is GroupKind.FULL:
        num_blocks = 0
        while (num_blocks + 1) * span <= cap and unit_available(unit, (num_blocks + 1) * span):
            num_blocks += 1
        hit = num_blocks * span
        tail_boundary = 0
        if fine:
            # Probe the interior hash boundaries of the first missing block, longest first.
            top = min(num_blocks * span + span - alignment, cap - cap % alignment)
            for boundary in range(top, num_blocks * span, -alignment):
                if unit_available(unit, boundary):
                    hit = tail_boundary = boundary
                    break
        hit -= hit % alignment
        return _UnitHit(hit, num_blocks, tail_boundary)
    if group.kind is GroupKind.MAMBA:
        step = hash_unit if fine else span
        for boundary in range(cap - cap % step, 0, -step):
            if not fine and boundary % alignment:
                continue
            if unit_available(unit, boundary):
                return _UnitHit(boundary)
        return _UnitHit(0)
    assert group.kind is GroupKind.SLIDING_WINDOW and group.sliding_window is not None
    num_needed = max(1, cdiv(group.sliding_window - 1, span))
    num_blocks = cap // span
    # run[i]: consecutive available blocks ending at block i.
    run = 0
    runs = []
    for i in range(num_blocks):
        run = run + 1 if unit_available(unit, (i + 1) * span) else 0
        runs.append(run)
    for i in range(num_blocks - 1, -1, -1):
        boundary = (i + 1) * span
        if boundary % alignment == 0 and runs[i] >= min(num_needed, i + 1):
            return _UnitHit(boundary)
    return _UnitHit(0)


def _sliding_window_blocks(group: GroupSpec, span: int, boundary: int) -> range:
    assert group.sliding_window is not None
    num_needed = max(1, cdiv(group.sliding_window - 1, span))
    end = boundary // span
    return range(max(0, end - num_needed), end)


def _build_plan(
    candidates: LookupCandidates, boundary: int, local: int, full_hits: Mapping[tuple[int, ...], _UnitHit]
) -> LoadPlan:
    scheme = candidates.scheme
    geometry = scheme.geometry
    hashes = candidates.block_hashes
    loads: list[BlockLoad] = []
    for unit in geometry.lookup_units:
        for g in unit:
            group = geometry.groups[g]
            span = geometry.spans[g]
            if group.kind is GroupKind.FULL:
                found = full_hits[unit]
                for i in range(local // span, cdiv(boundary, span)):
                    if i < found.num_full_blocks:
                        key_boundary = (i + 1) * span
                    else:
                        # The partial block: addressed by the boundary it was stored under.
                        key_boundary = found.tail_boundary
                        assert i == found.num_full_blocks and key_boundary >= boundary, (
                            f"group {g}: block {i} of a {boundary}-token hit has no entry covering it "
                            f"(tail at {key_boundary}); the fixed point is inconsistent"
                        )
                    loads.append(
                        BlockLoad(g, i, key_boundary, hashes[key_boundary // geometry.hash_unit - 1])
                    )
            elif group.kind is GroupKind.SLIDING_WINDOW:
                for i in _sliding_window_blocks(group, span, boundary):
                    if (i + 1) * span > local:
                        key_boundary = (i + 1) * span
                        loads.append(
                            BlockLoad(g, i, key_boundary, hashes[key_boundary // geometry.hash_unit - 1])
                        )
            else:
                # Mamba: one state, exactly at the boundary, in block cdiv(H, B) - 1.
                loads.append(
                    BlockLoad(
                        g, cdiv(boundary, span) - 1, boundary, hashes[boundary // geometry.hash_unit - 1]
                    )
                )
    loads.sort(key=lambda load: (load.group_index, load.block_index))
    return LoadPlan(
        scheme=scheme,
        boundary=boundary,
        num_computed_tokens=candidates.num_computed_tokens,
        loads=tuple(loads),
    )


# -- load plan and truncation ----------------------------------------------------------------------------


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


# -- save side ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveBlock:
    """One group block a save wave writes: ``block_index`` holding tokens up to ``key_boundary``."""

    group_index: int
    block_index: int
    key_boundary: int
    block_hash: bytes


@dataclass(frozen=True)
class SavePlan:
    """The entries one save wave writes on every rank, and the blocks that count as stored."""

    scheme: KeyScheme
    blocks: tuple[SaveBlock, ...]

    @cached_property
    def entries(self) -> tuple[tuple[EntryId, str], ...]:
        scheme = self.scheme
        return tuple(
            (
                EntryId(rank.tp_rank, block.group_index, block.block_index, block.key_boundary),
                scheme.key(block.group_index, rank.tp_rank, block.block_hash),
            )
            for rank in scheme.geometry.topology.ranks
            for block in self.blocks
        )

    def keys_for_rank(self, tp_rank: int) -> list[tuple[SaveBlock, str]]:
        return [
            (block, self.scheme.key(block.group_index, tp_rank, block.block_hash)) for block in self.blocks
        ]

    def stored_blocks(self, outcomes: Mapping[EntryId, bool]) -> tuple[SaveBlock, ...]:
        """Blocks stored on every rank: the only ones a ``BlockStored`` event may name."""
        ranks = self.scheme.geometry.topology.ranks
        return tuple(
            block
            for block in self.blocks
            if all(
                outcomes.get(
                    EntryId(r.tp_rank, block.group_index, block.block_index, block.key_boundary), False
                )
                for r in ranks
            )
        )


def plan_save(
    scheme: KeyScheme, block_hashes: Sequence[bytes], group_to_boundaries: Mapping[int, Iterable[int]]
) -> SavePlan:
    """Keys for the entries ending at the given boundaries (per group).

    Full attention: whole blocks end on multiples of the span, a prompt tail on its last hash boundary.
    Sliding window: whole blocks only. Mamba: the exact hand-off boundaries vLLM gives, never positions.
    """
    geometry = scheme.geometry
    unit = geometry.hash_unit
    blocks: list[SaveBlock] = []
    for group_index, boundaries in sorted(group_to_boundaries.items()):
        group = geometry.groups[group_index]
        span = geometry.spans[group_index]
        for boundary in boundaries:
            assert 0 < boundary <= len(block_hashes) * unit and boundary % unit == 0, (
                f"group {group_index}: save boundary {boundary} is not a hashed boundary "
                f"(hash unit {unit}, {len(block_hashes)} hashes)"
            )
            if group.kind is GroupKind.SLIDING_WINDOW:
                assert boundary % span == 0, f"group {group_index}: sliding-window saves are whole blocks"
            blocks.append(
                SaveBlock(group_index, cdiv(boundary, span) - 1, boundary, block_hashes[boundary // unit - 1])
            )
    return SavePlan(scheme=scheme, blocks=tuple(blocks))
