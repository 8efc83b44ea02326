"""The agreed boundary of one lookup (vLLM's hybrid fixed point) and the load plan of that answer.

``agreed_result(query, available_in_store)`` is the one place a lookup's answer is computed: the full scan
(``scan.py``) feeds it one batched ``exists`` over every candidate key, the search (``search.py``) the
facts it gathered in a few rounds; over the same store contents both give the same answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import KeyScheme, PlannedBlock
from hybridkv.lifecycle.kinds import UnitHit
from hybridkv.lifecycle.load import LoadPlan

__all__ = [
    "PAUSE_EVERY",
    "AvailableFn",
    "LookupQuery",
    "LookupResult",
    "UnitAvailableFn",
    "agreed_result",
    "key_cap",
    "lookup_cap",
]

#: Keys or boundaries per slice of a search's CPU work between two calls of its ``pause``.
PAUSE_EVERY = 256


def lookup_cap(scheme: KeyScheme, num_hashes: int, num_tokens: int, max_boundary: int | None = None) -> int:
    """The largest boundary a lookup may return: one token is always left to compute."""
    cap = min(num_tokens - 1, num_hashes * scheme.geometry.hash_unit)
    if max_boundary is not None:
        cap = min(cap, max_boundary)
    return max(cap, 0)


def key_cap(geometry: Geometry, cap: int, num_hashes: int) -> int:
    """The last boundary a lookup capped at ``cap`` may ask the store about: ``cap`` itself, or with EAGLE
    up to one margin past it (vLLM's EAGLE lookup matches past the candidate, then drops that part)."""
    if not geometry.eagle_lookahead:
        return cap
    return min(cap + geometry.eagle_lookahead, num_hashes * geometry.hash_unit)


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
class LookupQuery:
    """What one lookup asks: the request's block hashes and token counts, under ``scheme``, capped.

    ``max_boundary`` is the cap already applied (``lookup_cap``); ``local`` is the local hit floored to the
    hit alignment (every block ending at or before it is on the device and never loaded).
    """

    scheme: KeyScheme
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    num_computed_tokens: int
    max_boundary: int

    @property
    def local(self) -> int:
        return self.num_computed_tokens - self.num_computed_tokens % self.scheme.geometry.hit_alignment


def agreed_result(query: LookupQuery, available_in_store: AvailableFn) -> LookupResult:
    """The answer to ``query`` given which entries the store holds: ``available_in_store(group, boundary)``
    is True when that group's entry ending at ``boundary`` is present on every rank."""
    geometry = query.scheme.geometry
    local = query.local
    cap = query.max_boundary

    def available(group_index: int, boundary: int) -> bool:
        # Blocks ending at or before the local hit are on the device already (vLLM agreed on `local`).
        if boundary <= local and geometry.groups[group_index].rules.covered_by_local_hit:
            return True
        return available_in_store(group_index, boundary)

    def unit_available(unit: tuple[int, ...], boundary: int) -> bool:
        return all(available(g, boundary) for g in unit)

    max_tokens = len(query.block_hashes) * geometry.hash_unit
    boundary, contiguous_hits = _fixed_point(geometry, cap, unit_available, max_tokens)
    plan = None
    if boundary > query.num_computed_tokens:
        plan = _build_plan(query, boundary, local, contiguous_hits)
    return LookupResult(
        boundary=boundary,
        num_tokens=query.num_tokens,
        num_computed_tokens=query.num_computed_tokens,
        plan=plan,
        _geometry=geometry,
        _cap=cap,
        _unit_available=unit_available,
    )


def _fixed_point(
    geometry: Geometry, cap: int, unit_available: UnitAvailableFn, max_tokens: int
) -> tuple[int, dict[tuple[int, ...], UnitHit]]:
    """vLLM's hybrid fixed point: each unit may only shrink the candidate; a left-contiguous unit (full
    attention) is looked up once (at the candidate of its first visit) and then only trimmed.

    With ``Geometry.eagle`` (vLLM's EAGLE block dropping) a dropping unit (``Geometry.unit_drops``: one of
    its groups holds the drafter's layers, or no group is flagged) not yet verified at the current candidate
    looks past it by its EAGLE margin (up to ``max_tokens``, the tokens the hashes cover; no margin for a
    single group) and drops that part, at most once per candidate (a shrink by a pass without the drop
    clears the verifications); one group, or a simple hybrid (full attention + one other unit), takes one
    pass, as vLLM's coordinators do."""
    eagle = geometry.eagle
    units = geometry.lookup_units
    simple = len(units) == 2 and geometry.groups[units[0][0]].rules.left_contiguous
    one_pass = eagle and (geometry.is_single_group or simple)
    hit = cap
    contiguous_hits: dict[tuple[int, ...], UnitHit] = {}
    verified: set[tuple[int, ...]] = set()
    while True:
        current = hit
        for unit in units:
            rules = geometry.groups[unit[0]].rules
            if rules.left_contiguous and unit in contiguous_hits:
                current = min(current, contiguous_hits[unit].hit)
                continue
            drop = geometry.unit_drops(unit) and unit not in verified
            max_length = current
            if drop and rules.eagle_drops and not geometry.is_single_group:
                max_length = min(current + rules.eagle_margin(geometry, unit), max_tokens)
            found = rules.unit_hit(
                geometry, unit, max_length, functools.partial(unit_available, unit), drop=drop
            )
            if rules.left_contiguous:
                contiguous_hits[unit] = found
            if drop:
                verified.add(unit)
            elif found.hit < current:
                verified.clear()
            current = found.hit
        if current >= hit:
            return hit, contiguous_hits
        hit = current
        if one_pass:
            return hit, contiguous_hits


def _unit_hit(
    geometry: Geometry, unit: tuple[int, ...], cap: int, unit_available: UnitAvailableFn
) -> UnitHit:
    """The largest boundary <= ``cap`` that ``unit`` alone can restore, by its kind's rules."""
    return geometry.groups[unit[0]].rules.unit_hit(
        geometry, unit, cap, lambda boundary: unit_available(unit, boundary)
    )


def _build_plan(
    query: LookupQuery,
    boundary: int,
    local: int,
    contiguous_hits: Mapping[tuple[int, ...], UnitHit],
) -> LoadPlan:
    scheme = query.scheme
    geometry = scheme.geometry
    hashes = query.block_hashes
    loads: list[PlannedBlock] = []
    for unit in geometry.lookup_units:
        found = contiguous_hits.get(unit, UnitHit(boundary))
        for g in unit:
            rules = geometry.groups[g].rules
            for block_index, key_boundary in rules.blocks_to_load(geometry, g, boundary, local, found):
                loads.append(
                    PlannedBlock(g, block_index, key_boundary, scheme.boundary_hash(hashes, key_boundary))
                )
    loads.sort(key=lambda load: (load.group_index, load.block_index))
    plan = LoadPlan(
        scheme=scheme,
        boundary=boundary,
        num_computed_tokens=query.num_computed_tokens,
        loads=tuple(loads),
    )
    _ = plan.block_indexes_by_group  # computed here (the lookup thread), not in the scheduler's step
    return plan
