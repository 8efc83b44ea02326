"""Save plans: the entries a save wave writes, and which blocks count as stored."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from hybridkv.lifecycle.keys import EntryId, KeyScheme
from hybridkv.lifecycle.kinds import GroupKind, cdiv

__all__ = ["SaveBlock", "SavePlan", "plan_save"]


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
