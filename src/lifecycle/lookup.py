"""A lookup in a bounded number of batched existence checks: probe, confirm, and (rarely) scan.

``plan_lookup(...) -> LookupCandidates`` lists every key a lookup may need -- every candidate boundary
x every group x every rank -- for ONE ``store.exists``; ``LookupCandidates.resolve(exists)`` gives the
agreed boundary (the same fixed point as vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``,
each group's contribution by its kind's rules) and the exact ``LoadPlan``. At production geometry (a
128K-token prompt, hash unit 64, DCP 8, two groups) that is ~32K keys. ``LookupSearch`` finds the same
agreed boundary and the same load plan from far fewer keys, in a few rounds:

1. **probe** (one round): one key per (lookup unit, candidate boundary) -- the unit's first group on
   rank 0. Entries are saved on every rank by the same wave, so a probe is a good guess of "exists on
   every rank"; it is never trusted for a load.
2. **confirm** (usually one round): the agreed boundary under the guessed availability is computed with
   the same fixed point as vLLM's coordinator; then every key of its load plan (every group the plan
   loads, on every rank) is checked. All present: that is the answer. The first confirm also checks the
   few probed Mamba states just below that boundary (``MAX_STEP_BACK_STATES``), so a step back -- or the
   retry of a truncated load -- usually needs no further round trip.
3. **step back** (bounded): a confirm that finds a hole (an entry evicted on some rank, a wave stored on
   some ranks only) turns those keys into known facts and recomputes -- the boundary can only shrink.
   After ``max_confirm_rounds`` confirms, one **scan** checks every candidate key at or below the current
   boundary that is still unknown, which makes every fact the fixed point can look at exact.

Contract: the answer equals the full scan's answer over the same store contents (the fixed point only
shrinks as availability shrinks, and every key of the returned plan was seen present on every rank);
round trips: 2 when the store holds a clean prefix (or nothing), at most ``max_confirm_rounds + 2``
otherwise, plus one per extra scan in the (theoretical) case a scan uncovers a longer boundary.

``known`` (key -> present) may be shared by several searches of one request: a prefetch started when
the request was queued (local hit unknown, so 0) answers a later ask with the real local hit without
another round trip when it already covers that plan.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import KeyScheme, PlannedBlock, boundary_hash_index
from hybridkv.lifecycle.kinds import UnitHit
from hybridkv.lifecycle.load import LoadPlan

__all__ = [
    "DEFAULT_MAX_CONFIRM_ROUNDS",
    "MAX_STEP_BACK_STATES",
    "ExistsFn",
    "LookupCandidates",
    "LookupResult",
    "LookupSearch",
    "PortableResult",
    "lookup_cap",
    "plan_lookup",
    "portable_result",
    "result_from_portable",
]

ExistsFn = Callable[[Sequence[str]], Sequence[bool]]
_T = TypeVar("_T")

#: Keys or boundaries per slice of a search's CPU work between two calls of its ``pause``.
PAUSE_EVERY = 256

#: Probed states below the chosen boundary confirmed with its plan (per state group).
MAX_STEP_BACK_STATES = 16
#: Confirm rounds before the one scan of every unknown candidate key below the current boundary.
DEFAULT_MAX_CONFIRM_ROUNDS = 2


def lookup_cap(scheme: KeyScheme, num_hashes: int, num_tokens: int, max_boundary: int | None = None) -> int:
    """The largest boundary a lookup may return: one token is always left to compute."""
    cap = min(num_tokens - 1, num_hashes * scheme.geometry.hash_unit)
    if max_boundary is not None:
        cap = min(cap, max_boundary)
    return max(cap, 0)


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
        hash_unit = scheme.geometry.hash_unit
        loads: list[PlannedBlock] = []
        for start in range(0, len(groups), PAUSE_EVERY):
            stop = start + PAUSE_EVERY
            loads.extend(
                PlannedBlock(g, b, k, block_hashes[k // hash_unit - 1])
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


def key_cap(geometry: Geometry, cap: int, num_hashes: int) -> int:
    """The last boundary a lookup capped at ``cap`` may ask the store about: ``cap`` itself, or with EAGLE
    up to one margin past it (vLLM's EAGLE lookup matches past the candidate, then drops that part)."""
    if not geometry.eagle_lookahead:
        return cap
    return min(cap + geometry.eagle_lookahead, num_hashes * geometry.hash_unit)


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
    unit = geometry.hash_unit
    cap = lookup_cap(scheme, len(block_hashes), num_tokens, max_boundary)
    local = num_computed_tokens - num_computed_tokens % geometry.hit_alignment
    hashes = tuple(block_hashes)
    keys: list[str] = []
    index_of: dict[tuple[int, int], int] = {}
    last = key_cap(geometry, cap, len(hashes))
    for group_index, group in enumerate(geometry.groups):
        rank_prefixes = scheme.group_rank_prefixes[group_index]
        for boundary in group.rules.candidate_boundaries(geometry, group_index, local, last):
            index_of[(group_index, boundary)] = len(keys)
            hash_hex = hashes[boundary_hash_index(boundary, unit)].hex()
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


def _resolve(candidates: LookupCandidates, available_in_store: AvailableFn) -> LookupResult:
    geometry = candidates.scheme.geometry
    local = candidates.num_computed_tokens - candidates.num_computed_tokens % geometry.hit_alignment
    cap = candidates.max_boundary

    def available(group_index: int, boundary: int) -> bool:
        # Blocks ending at or before the local hit are on the device already (vLLM agreed on `local`).
        if boundary <= local and geometry.groups[group_index].rules.covered_by_local_hit:
            return True
        return available_in_store(group_index, boundary)

    def unit_available(unit: tuple[int, ...], boundary: int) -> bool:
        return all(available(g, boundary) for g in unit)

    max_tokens = len(candidates.block_hashes) * geometry.hash_unit
    boundary, contiguous_hits = _fixed_point(geometry, cap, unit_available, max_tokens)
    plan = None
    if boundary > candidates.num_computed_tokens:
        plan = _build_plan(candidates, boundary, local, contiguous_hits)
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
    candidates: LookupCandidates,
    boundary: int,
    local: int,
    contiguous_hits: Mapping[tuple[int, ...], UnitHit],
) -> LoadPlan:
    scheme = candidates.scheme
    geometry = scheme.geometry
    hashes = candidates.block_hashes
    unit_hash = geometry.hash_unit
    loads: list[PlannedBlock] = []
    for unit in geometry.lookup_units:
        found = contiguous_hits.get(unit, UnitHit(boundary))
        for g in unit:
            rules = geometry.groups[g].rules
            for block_index, key_boundary in rules.blocks_to_load(geometry, g, boundary, local, found):
                loads.append(
                    PlannedBlock(g, block_index, key_boundary, hashes[key_boundary // unit_hash - 1])
                )
    loads.sort(key=lambda load: (load.group_index, load.block_index))
    plan = LoadPlan(
        scheme=scheme,
        boundary=boundary,
        num_computed_tokens=candidates.num_computed_tokens,
        loads=tuple(loads),
    )
    _ = plan.block_indexes_by_group  # computed here (the lookup thread), not in the scheduler's step
    return plan


@dataclass
class LookupSearch:
    """One request's lookup as a sequence of batched existence checks.

    Drive it with ``next_keys()`` (the keys of the next round, or None when ``result`` is set) and
    ``feed(keys, exists)``. Pure: no store, no clock, no threads.
    """

    scheme: KeyScheme
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    num_computed_tokens: int
    max_boundary: int | None = None
    #: key -> present (on that key's rank); shared by the searches of one request incarnation.
    known: dict[str, bool] = field(default_factory=dict)
    max_confirm_rounds: int = DEFAULT_MAX_CONFIRM_ROUNDS
    #: ``[h.hex() for h in block_hashes]`` when the caller has it (searches of one request share it);
    #: otherwise the first ``next_keys`` makes it.
    block_hex: list[str] | None = None
    #: Called between slices of ``next_keys``' CPU work (about ``PAUSE_EVERY`` keys or boundaries each):
    #: a caller on a background thread hands the GIL to other threads there. The search's answer does
    #: not depend on it.
    pause: Callable[[], None] | None = None
    result: LookupResult | None = field(default=None, init=False)
    num_round_trips: int = field(default=0, init=False)
    num_keys: int = field(default=0, init=False)
    #: answers given from the exact facts alone because the facts changed under a guess (``next_keys``)
    num_inconsistent_guesses: int = field(default=0, init=False)
    _num_confirms: int = field(default=0, init=False)
    #: keys handed out by ``next_keys`` and not fed yet (asking again returns them, not a new round)
    _pending: tuple[str, ...] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        geometry = self.scheme.geometry
        cap = lookup_cap(self.scheme, len(self.block_hashes), self.num_tokens, self.max_boundary)
        local = self.num_computed_tokens - self.num_computed_tokens % geometry.hit_alignment
        # keys=(): the full scan's key list is exactly what this search avoids building.
        self._candidates = LookupCandidates(
            scheme=self.scheme,
            block_hashes=self.block_hashes,
            num_tokens=self.num_tokens,
            num_computed_tokens=self.num_computed_tokens,
            max_boundary=cap,
            keys=(),
            group_boundary_to_index={},
        )
        unit_first = {g: unit[0] for unit in geometry.lookup_units for g in unit}
        self._unit_first = unit_first
        self._local = local
        self._cap = cap
        self._cap_keys = key_cap(geometry, cap, len(self.block_hashes))
        # The hex forms are made by the first ``next_keys`` (on the lookup thread, not the caller's).
        self._hex: list[str] = []
        self._num_ticks = 0
        self._probed = False
        #: (group, boundary) -> whether present on every rank, from facts only (no probe)
        self._exact: dict[tuple[int, int], bool] = {}
        #: (group, boundary) pairs some of whose rank keys were not known when ``known`` last had
        #: ``_undecided_at`` facts
        self._undecided: set[tuple[int, int]] = set()
        self._undecided_at = -1  # len(known) when ``_undecided`` was filled (facts only grow)
        #: (group, boundary) the last guess took as present from a probe alone
        self._guessed_present: set[tuple[int, int]] = set()

    def _boundaries(self, group_index: int) -> Sequence[int]:
        """The candidate boundaries of one group (those ``plan_lookup`` lists), ascending."""
        geometry = self.scheme.geometry
        return geometry.groups[group_index].rules.candidate_boundaries(
            geometry, group_index, self._local, self._cap_keys
        )

    # -- keys -----------------------------------------------------------------------------------------

    def _rank_keys(self, group_index: int, boundary: int) -> list[str]:
        hash_hex = self._hex[boundary_hash_index(boundary, self.scheme.geometry.hash_unit)]
        return [prefix + hash_hex for prefix in self.scheme.group_rank_prefixes[group_index]]

    def _probe_key(self, group_index: int, boundary: int) -> str:
        prefix = self.scheme.group_rank_prefixes[self._unit_first[group_index]][0]
        return prefix + self._hex[boundary_hash_index(boundary, self.scheme.geometry.hash_unit)]

    # -- the search -----------------------------------------------------------------------------------

    def _exact_verdict(self, group_index: int, boundary: int) -> bool | None:
        """Present on every rank (True), absent on some (False), or not known yet (None)."""
        verdict = self._exact.get((group_index, boundary))
        if verdict is None:
            known = self.known
            if len(known) != self._undecided_at:  # new facts (``known`` may be shared): decide again
                self._undecided.clear()
                self._undecided_at = len(known)
            elif (group_index, boundary) in self._undecided:
                return None
            facts = [known.get(key) for key in self._rank_keys(group_index, boundary)]
            if False in facts:
                verdict = False
            elif None in facts:
                self._undecided.add((group_index, boundary))
                return None
            else:
                verdict = True
            self._exact[(group_index, boundary)] = verdict  # facts only grow: a verdict never changes
        return verdict

    def _guess(self) -> LookupResult:
        """The fixed point under the current facts: exact where known, the probe elsewhere. Records in
        ``_guessed_present`` every entry a probe said present but not every rank has confirmed (a probe
        that says absent is exact: that rank's key is missing)."""
        known = self.known
        guessed = self._guessed_present
        guessed.clear()
        record = self.scheme.geometry.eagle  # only an EAGLE answer rests on entries past its plan

        def available_in_store(group_index: int, boundary: int) -> bool:
            verdict = self._exact_verdict(group_index, boundary)
            if verdict is None:
                present = known.get(self._probe_key(group_index, boundary), False)
                if present and record:
                    guessed.add((group_index, boundary))
                return present
            return verdict

        return _resolve(self._candidates, self._with_pauses(available_in_store))

    def _tick(self, num_ticks: int = 1) -> None:
        """``num_ticks`` keys or boundaries of work done: ``pause`` each time the count passes a multiple of
        ``PAUSE_EVERY``."""
        before = self._num_ticks
        self._num_ticks += num_ticks
        if self._num_ticks // PAUSE_EVERY != before // PAUSE_EVERY and self.pause is not None:
            self.pause()

    def _with_pauses(self, available: AvailableFn) -> AvailableFn:
        """``available``, one tick per call."""
        if self.pause is None:
            return available

        def paused(group_index: int, boundary: int) -> bool:
            self._tick()
            return available(group_index, boundary)

        return paused

    def _paused(self, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, one tick per item."""
        if self.pause is None:
            yield from items
            return
        for item in items:
            yield item
            self._tick()

    def next_keys(self) -> tuple[str, ...] | None:
        """The keys to check next (one batched ``exists``), or None: ``result`` holds the answer."""
        if self.result is not None:
            return None
        if self._pending is None:
            if not self._hex:
                if self.block_hex is None or len(self.block_hex) < len(self.block_hashes):
                    self.block_hex = [block_hash.hex() for block_hash in self.block_hashes]
                self._hex = self.block_hex
            self._pending = self._next_keys()
        return self._pending

    def _next_keys(self) -> tuple[str, ...] | None:
        known = self.known
        if not self._probed:
            geometry = self.scheme.geometry
            probes: list[str] = []
            hexes, hash_unit = self._hex, geometry.hash_unit
            for unit in geometry.lookup_units:
                prefix = self.scheme.group_rank_prefixes[self._unit_first[unit[0]]][0]  # as _probe_key
                boundaries = self._boundaries(unit[0])
                # In slices of PAUSE_EVERY boundaries, each one comprehension (a 128K-token prompt has
                # thousands): a generator with a tick per boundary cost several times the keys' own work.
                # The key rule (``boundary_hash_index``) inline: a call per key would double this loop.
                for start in range(0, len(boundaries), PAUSE_EVERY):
                    keys = [
                        prefix + hexes[b // hash_unit - 1] for b in boundaries[start : start + PAUSE_EVERY]
                    ]
                    probes.extend([key for key in keys if key not in known] if known else keys)
                    self._tick(len(keys))
            self._probed = True  # fed next (or the search ends with its task): never listed again
            if probes:
                return tuple(probes)
        while True:
            guess = self._guess()
            eagle = self.scheme.geometry.eagle
            if guess.plan is None and not (eagle and self._guessed_present):
                # No hit even with guessed availability; real availability is a subset: no hit.
                self.result = guess
                return None
            plan_loads = guess.plan.loads if guess.plan is not None else ()
            pairs = dict.fromkeys((load.group_index, load.key_boundary) for load in plan_loads)
            if eagle:
                # An EAGLE answer also rests on entries past it (matched, then dropped), and vLLM's EAGLE
                # fixed point is not monotone in its entries: confirm every entry the guess took as present,
                # so the answer is the full scan's.
                pairs.update(dict.fromkeys(sorted(self._guessed_present)))
            unknown_pairs = [pair for pair in self._paused(pairs) if self._exact_verdict(*pair) is None]
            if not unknown_pairs:
                # Every entry of the plan was seen present on every rank -- unless the facts changed under
                # the guess (one known absent would have made its boundary unavailable). Facts only grow
                # while nobody else writes ``known``; should anything ever do, the answer is the one the
                # exact facts alone give (every entry seen present on every rank: never a wrong load),
                # counted, instead of an assertion that would stop the engine.
                if not all(self._exact_verdict(load.group_index, load.key_boundary) for load in plan_loads):
                    self.num_inconsistent_guesses += 1
                    guess = _resolve(
                        self._candidates,
                        self._with_pauses(lambda g, b: self._exact_verdict(g, b) is True),
                    )
                self.result = guess
                return None
            unknown = tuple(
                key
                for pair in self._paused(unknown_pairs)
                for key in self._rank_keys(*pair)
                if key not in known
            )
            if self._num_confirms < self.max_confirm_rounds:
                self._num_confirms += 1
                if self._num_confirms == 1:
                    unknown += self._step_back_keys(guess.boundary)
                return tuple(dict.fromkeys(unknown))
            # The last resort: every candidate the answer can rest on (with EAGLE, past it too).
            limit = self._cap_keys if self.scheme.geometry.eagle else guess.boundary
            scan = tuple(
                key
                for g in range(self.scheme.geometry.num_groups)
                for b in self._paused(self._boundaries(g))
                if b <= limit
                for key in self._rank_keys(g, b)
                if key not in known
            )
            if scan:
                return scan
            return unknown  # pragma: no cover -- the plan's keys are candidate keys <= its boundary

    def _step_back_keys(self, boundary: int) -> tuple[str, ...]:
        """Every rank's key of the probed entries a short step back below ``boundary`` needs.

        Mamba: the ``MAX_STEP_BACK_STATES`` nearest probed states (states are saved at a few hand-off
        boundaries only). Sliding window: the blocks of the windows of as many block boundaries below.
        Confirming them with the plan makes a step back (a hole found by this confirm, or a truncated
        load's retry below its cap) answerable from facts, without another round trip.
        """
        geometry = self.scheme.geometry
        keys: list[str] = []
        for group_index, group in enumerate(geometry.groups):

            def probed(group_index: int, b: int) -> bool:
                return bool(self.known.get(self._probe_key(group_index, b)))

            boundaries = group.rules.step_back_boundaries(
                geometry,
                group_index,
                boundary,
                self._boundaries(group_index),
                functools.partial(self._with_pauses(probed), group_index),
                MAX_STEP_BACK_STATES,
            )
            for b in boundaries:
                keys.extend(key for key in self._rank_keys(group_index, b) if key not in self.known)
        return tuple(keys)

    def feed(self, keys: Sequence[str], exists: Sequence[bool]) -> None:
        """Record one round's answers (an error for a key counts as absent)."""
        assert len(keys) == len(exists), f"exists() returned {len(exists)} results for {len(keys)} keys"
        self._pending = None
        self.num_round_trips += 1
        self.num_keys += len(keys)
        self.known.update(zip(keys, exists, strict=True))

    def run(self, exists: ExistsFn) -> LookupResult:
        """Drive the search to its answer with a blocking ``exists`` (tests, benches)."""
        while (keys := self.next_keys()) is not None:
            self.feed(keys, exists(keys))
        assert self.result is not None
        return self.result
