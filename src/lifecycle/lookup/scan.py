"""The full scan: every key one lookup may need, in one batched existence check.

``plan_lookup(...) -> LookupCandidates`` lists every candidate boundary x every group x every rank;
``LookupCandidates.resolve(exists)`` gives the agreed boundary and the exact ``LoadPlan``. The runtime
runs the search (``search.py``), which finds the same answer from far fewer keys; the full scan is its
oracle (the lifecycle fuzzer checks the search against it) and what tests and benches compare with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.lookup.agreement import LookupQuery, LookupResult, agreed_result, key_cap, lookup_cap

__all__ = ["LookupCandidates", "plan_lookup"]


@dataclass(frozen=True)
class LookupCandidates(LookupQuery):
    """Every key one lookup may need, in one batch: pass ``keys`` to ``store.exists`` once.

    Build with ``plan_lookup``; then ``resolve(exists)`` with one bool per key, in order.
    """

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

        return agreed_result(self, available_in_store)


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
        num_computed_tokens: the local hit vLLM passes (a multiple of the hit alignment, which is the
            hash unit on fine-grained hybrids -- not necessarily of the scheduler block: every block
            ending at or before it is local and never loaded; a value that is not aligned is floored for
            planning, but a hit must still exceed the value given).
        max_boundary: an extra cap (after a truncation: the truncated boundary).
    """
    geometry = scheme.geometry
    cap = lookup_cap(scheme, len(block_hashes), num_tokens, max_boundary)
    local = num_computed_tokens - num_computed_tokens % geometry.hit_alignment
    hashes = tuple(block_hashes)
    block_hex = [block_hash.hex() for block_hash in hashes]
    keys: list[str] = []
    index_of: dict[tuple[int, int], int] = {}
    last = key_cap(geometry, cap, len(hashes))
    for group_index, group in enumerate(geometry.groups):
        for boundary in group.rules.candidate_boundaries(geometry, group_index, local, last):
            index_of[(group_index, boundary)] = len(keys)
            keys.extend(scheme.boundary_rank_keys(group_index, block_hex, boundary))
    return LookupCandidates(
        scheme=scheme,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_computed_tokens=num_computed_tokens,
        max_boundary=cap,
        keys=tuple(keys),
        group_boundary_to_index=index_of,
    )
