"""A lookup's answer as plain data, for a search run in another process (``lookup_process: true``).

``portable_result`` turns a ``LookupResult`` into integers and arrays of them (what the lookup process
sends back); ``result_from_portable`` rebuilds the result on the receiving side, which holds the block
hashes the plan's keys are made of.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from hybridkv.lifecycle.keys import KeyScheme, PlannedBlock
from hybridkv.lifecycle.load import LoadPlan
from hybridkv.lifecycle.lookup.agreement import PAUSE_EVERY, LookupResult

__all__ = ["PortableResult", "portable_result", "result_from_portable"]

#: A ``LookupResult`` as plain data, for a search run in another process (``portable_result``): boundary,
#: num_tokens, num_computed_tokens, group_hit_tokens, and the plan as (boundary, num_computed_tokens,
#: group_index / block_index / key_boundary of each planned block) or ``None``.
PortableResult = tuple[
    int, int, int, tuple[int, ...], tuple[int, int, "array[int]", "array[int]", "array[int]"] | None
]


def _no_facts(_unit: tuple[int, ...], _boundary: int) -> bool:
    raise AssertionError("a result rebuilt from another process carries its group_hit_tokens precomputed")


def portable_result(result: LookupResult) -> PortableResult:
    """``result`` as plain data (integers and arrays of them): what a lookup process sends back. The block
    hashes stay out (the receiver has them), and ``group_hit_tokens`` is computed here, from the facts
    the search gathered."""
    plan = result.plan
    portable_plan = None
    if plan is not None:
        portable_plan = (
            plan.boundary,
            plan.num_computed_tokens,
            array("q", [load.group_index for load in plan.loads]),
            array("q", [load.block_index for load in plan.loads]),
            array("q", [load.key_boundary for load in plan.loads]),
        )
    return (
        result.boundary,
        result.num_tokens,
        result.num_computed_tokens,
        result.group_hit_tokens,
        portable_plan,
    )


def result_from_portable(
    portable: PortableResult,
    scheme: KeyScheme,
    block_hashes: Sequence[bytes],
    pause: Callable[[], None] | None = None,
) -> LookupResult:
    """The ``LookupResult`` ``portable_result`` described, for the request whose ``block_hashes`` (and key
    ``scheme``) the search ran on; ``pause`` is called every ``PAUSE_EVERY`` planned blocks."""
    boundary, num_tokens, num_computed_tokens, group_hit_tokens, portable_plan = portable
    plan = None
    if portable_plan is not None:
        plan_boundary, plan_computed, groups, block_indexes, key_boundaries = portable_plan
        loads: list[PlannedBlock] = []
        for start in range(0, len(groups), PAUSE_EVERY):
            stop = start + PAUSE_EVERY
            loads.extend(
                PlannedBlock(g, b, k, scheme.boundary_hash(block_hashes, k))
                for g, b, k in zip(
                    groups[start:stop], block_indexes[start:stop], key_boundaries[start:stop], strict=True
                )
            )
            if pause is not None:
                pause()
        plan = LoadPlan(
            scheme=scheme, boundary=plan_boundary, num_computed_tokens=plan_computed, loads=tuple(loads)
        )
        _ = plan.block_indexes_by_group  # here, off the scheduler's step (as ``_build_plan``)
    result = LookupResult(
        boundary, num_tokens, num_computed_tokens, plan, scheme.geometry, boundary, _no_facts
    )
    result.__dict__["group_hit_tokens"] = tuple(group_hit_tokens)  # the cached property, precomputed
    return result
