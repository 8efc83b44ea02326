"""The search: one request's lookup in a bounded number of batched existence checks.

``LookupSearch`` finds the full scan's answer (``scan.py``) from far fewer keys, in a few rounds: probe,
confirm, step back, and (rarely) one scan (the package's docstring tells the rounds and their contract).
Pure: no store, no clock, no threads; the connector drives it on its lookup thread or process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.lookup.agreement import (
    PAUSE_EVERY,
    AvailableFn,
    LookupQuery,
    LookupResult,
    agreed_result,
    key_cap,
    lookup_cap,
)

__all__ = ["DEFAULT_MAX_CONFIRM_ROUNDS", "MAX_STEP_BACK_STATES", "ExistsFn", "LookupSearch"]

ExistsFn = Callable[[Sequence[str]], Sequence[bool]]
_T = TypeVar("_T")

#: Probed states below the chosen boundary confirmed with its plan (per state group).
MAX_STEP_BACK_STATES = 16
#: Confirm rounds before the one scan of every unknown candidate key below the current boundary.
DEFAULT_MAX_CONFIRM_ROUNDS = 2


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
        self._query = LookupQuery(
            scheme=self.scheme,
            block_hashes=self.block_hashes,
            num_tokens=self.num_tokens,
            num_computed_tokens=self.num_computed_tokens,
            max_boundary=cap,
        )
        unit_first = {g: unit[0] for unit in geometry.lookup_units for g in unit}
        self._unit_first = unit_first
        self._local = self._query.local
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
        """Every rank's key of the entry of ``group_index`` ending at ``boundary``."""
        return self.scheme.boundary_rank_keys(group_index, self._hex, boundary)

    def _probe_key(self, group_index: int, boundary: int) -> str:
        """The one key that probes ``boundary`` for ``group_index``'s lookup unit: its first group, rank 0."""
        return self.scheme.boundary_key(self._unit_first[group_index], 0, self._hex, boundary)

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

        return agreed_result(self._query, self._with_pauses(available_in_store))

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
            for unit in geometry.lookup_units:
                probed_group = self._unit_first[unit[0]]  # as _probe_key
                boundaries = self._boundaries(unit[0])
                # In slices of PAUSE_EVERY boundaries, each one call (a 128K-token prompt has thousands): a
                # generator with a tick per boundary cost several times the keys' own work.
                for start in range(0, len(boundaries), PAUSE_EVERY):
                    keys = self.scheme.boundaries_keys(
                        probed_group, 0, self._hex, boundaries[start : start + PAUSE_EVERY]
                    )
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
                    guess = agreed_result(
                        self._query,
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
