"""Cache kinds: how one prefix-cacheable KV-cache group is restored at a boundary."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["GroupKind", "GroupSpec", "cdiv"]


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
