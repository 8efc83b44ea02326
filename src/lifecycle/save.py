"""Save plans: the entries a save wave writes, and which blocks count as stored.

``plan_save(...) -> SavePlan``: the keys of the blocks a save wave writes, and which blocks count as
stored (every rank OK) so that events are published only for stored entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from hybridkv.lifecycle.keys import EntryId, KeyScheme, PlannedBlock, boundary_hash_index
from hybridkv.lifecycle.kinds import cdiv

__all__ = ["SavePlan", "plan_save"]


@dataclass(frozen=True)
class SavePlan:
    """The entries one save wave writes on every rank, and the blocks that count as stored."""

    scheme: KeyScheme
    blocks: tuple[PlannedBlock, ...]

    @cached_property
    def entries(self) -> tuple[tuple[EntryId, str], ...]:
        """Every (entry, key) of the plan, rank-major."""
        return self.scheme.entries(self.blocks)

    def stored_blocks(self, outcomes: Mapping[EntryId, bool]) -> tuple[PlannedBlock, ...]:
        """Blocks stored on every rank: the only ones a ``BlockStored`` event may name."""
        ranks = self.scheme.geometry.topology.ranks
        return tuple(
            block for block in self.blocks if all(outcomes.get(block.entry(r.tp_rank), False) for r in ranks)
        )


def plan_save(
    scheme: KeyScheme, block_hashes: Sequence[bytes], group_to_boundaries: Mapping[int, Iterable[int]]
) -> SavePlan:
    """Keys for the entries ending at the given boundaries (per group).

    Full attention: whole blocks end on multiples of the span, a prompt tail on its last hash boundary.
    Sliding window: whole blocks only. Mamba: the exact hand-off boundaries vLLM gives, never positions.
    (Each kind checks its boundaries: ``KindRules.check_save_boundary``.)
    """
    geometry = scheme.geometry
    unit = geometry.hash_unit
    blocks: list[PlannedBlock] = []
    for group_index, boundaries in sorted(group_to_boundaries.items()):
        rules = geometry.groups[group_index].rules
        span = geometry.spans[group_index]
        for boundary in boundaries:
            assert 0 < boundary <= len(block_hashes) * unit and boundary % unit == 0, (
                f"group {group_index}: save boundary {boundary} is not a hashed boundary "
                f"(hash unit {unit}, {len(block_hashes)} hashes)"
            )
            rules.check_save_boundary(geometry, group_index, boundary)
            blocks.append(
                PlannedBlock(
                    group_index,
                    cdiv(boundary, span) - 1,
                    boundary,
                    block_hashes[boundary_hash_index(boundary, unit)],
                )
            )
    return SavePlan(scheme=scheme, blocks=tuple(blocks))
