"""Deployment geometry: the prefix-cacheable groups, the parallel topology, and the sizes vLLM derives.

Pure arithmetic over plain ints (no vLLM, no torch), so the scheduler half and the worker half of the
connector compute the same answers from the same inputs. ``Geometry`` holds the groups (in vLLM's
``prefix_cacheable_group_ids`` order; the store group index is the position in ``Geometry.groups``),
their effective spans ``B_g = block_size * (dcp if dcp_sharded else 1)``, the scheduler block (lcm of
spans), the hash unit ``h`` (gcd, or a prefix-match unit dividing every span) and the hit alignment vLLM
uses (``h`` when fine-grained "partial hash hits" are on, else the scheduler block). What each kind of
group contributes is its rules' business (``hybridkv.lifecycle.kinds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from hybridkv.lifecycle.kinds import GroupSpec

__all__ = ["Geometry", "Rank", "Topology"]


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
        eagle: vLLM drops the last block of a hit for an EAGLE / MTP drafter (``speculative_config.
            use_eagle_block_drop()``): the drafter needs the target's hidden states of the tokens right
            before the generation point, so they are recomputed. Lookups then follow vLLM's EAGLE rules
            (``KindRules.unit_hit(drop=True)``). Not in :meth:`describe` (keys do not depend on it).
        eagle_groups: with ``eagle``, the store groups vLLM flags ``is_eagle_group`` (those holding the
            drafter's layers); a lookup unit drops when any of its groups is flagged (vLLM's coordinator
            flags the spec group). None: every group (vLLM's fallback when no group is flagged). Not in
            :meth:`describe`.
        hash_lookahead: vLLM 0.34's ``num_hash_lookahead_tokens`` (L): every block hash also covers the L
            tokens after its block (the drafter's KV at the block's last positions reads that far), and
            vLLM turns the EAGLE drop off, so ``eagle`` is False whenever L > 0. It changes what a block
            hash means, so it is in :meth:`describe` (the key fingerprint) when positive; at 0 (vLLM 0.32 and
            0.33 always) it is left out, so those keys stay what they always were. A save keys a block only
            once its KV is final: vLLM re-prefills the last ``L - 1`` tokens of a chunk
            (:attr:`num_unfinal_tokens`).
    """

    groups: tuple[GroupSpec, ...]
    topology: Topology = field(default_factory=Topology)
    prefix_match_unit: int | None = None
    other_group_spans: tuple[int, ...] = ()
    eagle: bool = False
    eagle_groups: frozenset[int] | None = None
    hash_lookahead: int = 0

    def __post_init__(self) -> None:
        assert self.groups, "a Geometry needs at least one prefix-cacheable group"
        assert self.hash_lookahead >= 0, f"hash_lookahead must be >= 0, got {self.hash_lookahead}"
        assert not (self.eagle and self.hash_lookahead), (
            f"hash_lookahead={self.hash_lookahead} with eagle=True: vLLM turns the EAGLE drop off when block "
            "hashes cover the drafter's lookahead"
        )
        dcp = self.topology.dcp_size
        for index, group in enumerate(self.groups):
            if dcp > 1:
                assert group.rules.supports_dcp, (
                    f"group {index}: {group.rules.name} is not supported under DCP={dcp}"
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
        # Some group (a Mamba state inside a block) asks for fine hits, and no group forbids them.
        enabled = any(g.rules.enables_fine_hits(g, unit, dcp) for g in self.groups)
        permitted = all(
            g.rules.permits_fine_hits(span, unit) for g, span in zip(self.groups, self.spans, strict=True)
        )
        return enabled and permitted

    @cached_property
    def eagle_drop_groups(self) -> frozenset[int]:
        """The groups whose lookup unit an EAGLE lookup drops in: every group of a unit holding a flagged
        group (``eagle_groups``; all of them when None); none without ``eagle``."""
        if not self.eagle:
            return frozenset()
        flagged = self.eagle_groups
        return frozenset(
            g for unit in self.lookup_units if flagged is None or not flagged.isdisjoint(unit) for g in unit
        )

    def group_drops(self, group_index: int) -> bool:
        """Whether an EAGLE lookup drops in the lookup unit of ``group_index``."""
        return group_index in self.eagle_drop_groups

    def unit_drops(self, unit: tuple[int, ...]) -> bool:
        """Whether an EAGLE lookup drops in ``unit``."""
        return unit[0] in self.eagle_drop_groups

    @cached_property
    def eagle_lookahead(self) -> int:
        """Tokens an EAGLE lookup may look past its cap (the widest dropping unit's margin; 0 without EAGLE,
        or for one group, whose vLLM coordinator looks up once without a margin)."""
        if not self.eagle or self.is_single_group:
            return 0
        return max(
            (self.groups[u[0]].rules.eagle_margin(self, u) for u in self.lookup_units if self.unit_drops(u)),
            default=0,
        )

    @property
    def num_unfinal_tokens(self) -> int:
        """Computed tokens at the end of a request's computed range whose KV is not final yet: vLLM's
        ``num_prefill_lookahead - 1`` re-prefillable tokens under lookahead hashes (L - 1; a multi-module MTP
        drafter rewrites them with the next chunk), which vLLM's own prefix cache does not cache either.
        0 without lookahead hashes (the legacy regime keeps its behaviour)."""
        return max(0, self.hash_lookahead - 1)

    def num_final_tokens(self, num_computed_tokens: int) -> int:
        """Of ``num_computed_tokens`` (a request's computed range), those whose KV is final: all of them
        without lookahead hashes, all but the last :attr:`num_unfinal_tokens` with them."""
        return max(0, num_computed_tokens - self.num_unfinal_tokens)

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
        """Groups looked up together, in vLLM's order: equal specs merged, left-contiguous kinds (full
        attention) first."""
        units: list[list[int]] = []
        for index, group in enumerate(self.groups):
            for unit in units:
                if self.groups[unit[0]] == group:
                    unit.append(index)
                    break
            else:
                units.append([index])
        units.sort(key=lambda unit: not self.groups[unit[0]].rules.left_contiguous)
        return tuple(tuple(unit) for unit in units)

    def describe(self) -> dict[str, object]:
        """What the key fingerprint covers. ``hash_lookahead`` only when positive: keys of engines without
        lookahead hashes (every vLLM before 0.34) are unchanged."""
        described: dict[str, object] = {
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
        if self.hash_lookahead:
            described["hash_lookahead"] = self.hash_lookahead
        return described
