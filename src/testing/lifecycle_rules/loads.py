"""The loads of the lifecycle fuzz machine: the scheduler takes or declines a hit, the connector refuses,
a namespace reset, loads that finish (all OK, random faults, split, through the fault patterns) judged
against a brute-force retry cap, and requests that leave."""

from __future__ import annotations

from hybridkv.lifecycle.keys import EntryId
from hybridkv.lifecycle.kinds import GroupKind, cdiv
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.lifecycle.table import MAX_LOAD_RETRIES, State
from hybridkv.testing.lifecycle_rules.model import FuzzRequest, LifecycleModel
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

__all__ = ["LOAD_FAULTS", "REFUSABLE_STATES", "LoadRules"]

#: Load states the connector may refuse from (every live one but REFUSED).
REFUSABLE_STATES = (
    State.NEW,
    State.LOOKUP,
    State.MISS,
    State.PARTIAL_HIT,
    State.LOADING,
    State.VERIFIED,
    State.TRUNCATED,
)

#: Load faults a rank may report for an entry that is in the store.
LOAD_FAULTS = (LoadOutcome.CORRUPT, LoadOutcome.MISSING, LoadOutcome.TIMEOUT, LoadOutcome.TRANSPORT_ERROR)


class LoadRules(LifecycleModel):
    """Rules from a hit to its verdict, and requests leaving; ``_load`` is also what the scenarios call."""

    @precondition(lambda self: bool(self._live(State.PARTIAL_HIT)))
    @rule(data=st.data())
    def scheduler_takes_hit(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._live(State.PARTIAL_HIT)))
        req = self.requests[request_id]
        if data.draw(st.integers(0, 5)) == 0:
            req.lifecycle.decline()
            return
        stale = req.lifecycle.is_stale
        started = req.lifecycle.start_load()
        assert started == (not stale), f"{request_id}: a load of a hit answered before a reset started"
        if not started:
            req.lifecycle.refuse("the hit was answered before a namespace reset")
            return
        req.num_loads += 1
        assert req.num_loads <= 1 + MAX_LOAD_RETRIES, (
            f"{request_id}: load #{req.num_loads}: retries unbounded"
        )

    @precondition(lambda self: bool(self._live(*REFUSABLE_STATES)))
    @rule(data=st.data())
    def connector_refuses(self, data: st.DataObject) -> None:
        """The connector refuses what vLLM allocated (no plan, a mismatch): final for the incarnation."""
        request_id = data.draw(st.sampled_from(self._live(*REFUSABLE_STATES)))
        req = self.requests[request_id]
        req.lifecycle.refuse("allocation does not match the plan")
        assert not req.lifecycle.may_hit and req.lifecycle.num_external_tokens == 0

    @rule(data=st.data())
    def namespace_reset(self, data: st.DataObject) -> None:
        """A namespace reset: the store is emptied; hits answered before it are stale. The connector
        revokes them at once (or, drawn, leaves one for the ``answer_current`` guard to refuse)."""
        self.machine.begin_epoch()
        self.store.clear()
        self.events_published.clear()  # the reset's AllBlocksCleared
        for req in self.requests.values():
            if req.lifecycle.current is State.PARTIAL_HIT and data.draw(st.booleans(), label="revoke now"):
                req.lifecycle.revoke("namespace reset")
                assert req.lifecycle.num_external_tokens == 0

    @precondition(lambda self: bool(self._live(State.LOADING)))
    @rule(data=st.data())
    def load_finishes(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._live(State.LOADING)))
        req = self.requests[request_id]
        modes = ["ok", "ok", "random", "split"] + (["patterns", "patterns"] if self.faulty else [])
        mode = data.draw(st.sampled_from(modes), label="load_mode")
        self._load(data, req, mode)

    def _load(self, data: st.DataObject, req: FuzzRequest, mode: str) -> None:
        """Finish ``req``'s load: "ok", "random" failures, "split" (a rank stops at its first failure),
        "fail" (at least one entry of the plan fails on some rank), or "patterns" (each rank's batch
        through the fault patterns)."""
        lookup = req.lifecycle.lookup
        assert lookup is not None and lookup.plan is not None
        plan = lookup.plan
        forced = (
            data.draw(st.sampled_from(plan.entries), label="forced_failure")[0] if mode == "fail" else None
        )
        outcomes: dict[EntryId, LoadOutcome] = {}
        for tp_rank in range(self.geometry.topology.tp_size):
            if mode == "patterns":
                rank_outcomes = self._load_through_patterns(plan, tp_rank)
                outcomes.update(rank_outcomes)
                faulted = any(outcome.is_fault for outcome in rank_outcomes.values())
                event(f"load through fault patterns: a rank's batch {'faulted' if faulted else 'loaded'}")
                continue
            failed_early = False
            cut = data.draw(st.integers(0, len(plan.loads) + 2)) if mode == "split" else None
            for position, (load, key) in enumerate(plan.loads_for_rank(tp_rank)):
                entry = EntryId(tp_rank, load.group_index, load.block_index, load.key_boundary)
                if failed_early:
                    continue  # not attempted
                if key not in self.store:
                    outcome = LoadOutcome.MISSING  # evicted between lookup and load
                elif (
                    entry == forced
                    or (mode == "split" and position == cut)
                    or (mode in ("random", "fail") and data.draw(st.integers(0, 4)) == 0)
                ):
                    outcome = data.draw(st.sampled_from(LOAD_FAULTS), label="fault")
                else:
                    outcome = LoadOutcome.OK
                outcomes[entry] = outcome
                if mode == "split" and outcome.is_fault:
                    failed_early = True
        resolution = req.lifecycle.finish_load(outcomes)
        all_ok = all(outcomes.get(entry) is LoadOutcome.OK for entry, _ in plan.entries)
        assert resolution.verified == all_ok
        cap = resolution.retry_cap
        event(
            "load: verified"
            if resolution.verified
            else f"load: truncated (retry={req.retrying}, cap>local: {cap > req.num_computed_tokens})"
        )
        if resolution.verified:
            assert req.lifecycle.current is State.VERIFIED
            return
        assert req.lifecycle.current is State.TRUNCATED
        req.num_truncations += 1
        local = req.num_computed_tokens - req.num_computed_tokens % self.geometry.scheduler_block_size
        assert local <= cap <= plan.boundary and cap % self.geometry.hit_alignment == 0, (
            f"retry cap {cap} outside [{local}, {plan.boundary}] or unaligned"
        )
        not_attempted = LoadOutcome.NOT_ATTEMPTED
        failed = [entry for entry, _ in plan.entries if outcomes.get(entry, not_attempted).is_fault]
        assert set(resolution.failed_entries) == set(failed)
        assert cap == self._oracle_cap(plan.boundary, failed), (
            f"retry cap {cap} != oracle {self._oracle_cap(plan.boundary, failed)} (failed: {failed})"
        )
        invalid = set(resolution.invalid_keys)
        # Only definite faults remove entries, each on every rank; transient faults and unattempted
        # entries keep theirs (hard rule 3 bars them for this request through the cap alone).
        bad_blocks = {
            (e.group_index, e.block_index, e.key_boundary)
            for e, _ in plan.entries
            if outcomes.get(e, not_attempted).invalidates
        }
        expected = {
            key for e, key in plan.entries if (e.group_index, e.block_index, e.key_boundary) in bad_blocks
        }
        assert invalid == expected, (
            f"invalidated {sorted(invalid - expected)} (not a definite fault), kept {sorted(expected - invalid)}"
        )
        self.store.difference_update(invalid)
        self.invalidated |= invalid
        req.cap = cap if req.cap is None else min(req.cap, cap)
        assert req.lifecycle.max_boundary == req.cap, (
            f"lifecycle cap {req.lifecycle.max_boundary} != the tightest truncation cap {req.cap}"
        )

    def _oracle_cap(self, planned: int, failed: list[EntryId]) -> int:
        """Brute force: the largest aligned boundary (strictly below ``planned`` if anything failed)
        none of whose needed (group, block[, boundary]) entries failed on any rank."""
        geometry = self.geometry
        alignment = geometry.hit_alignment
        top = planned - 1 if failed else planned
        bad = {(e.group_index, e.block_index) for e in failed}
        bad_states = {(e.group_index, e.key_boundary) for e in failed}
        for boundary in range(top - top % alignment, 0, -alignment):
            needed: set[tuple[int, int]] = set()
            blocked = False
            for g, (group, span) in enumerate(zip(geometry.groups, geometry.spans, strict=True)):
                if group.kind is GroupKind.FULL:
                    needed.update((g, i) for i in range(cdiv(boundary, span)))
                elif group.kind is GroupKind.SLIDING_WINDOW:
                    assert group.sliding_window is not None
                    window = max(1, cdiv(group.sliding_window - 1, span)) * span
                    # every block holding a token of [boundary - window, boundary)
                    needed.update((g, p // span) for p in range(max(0, boundary - window), boundary))
                else:
                    blocked |= (g, boundary) in bad_states
            if not blocked and not (needed & bad):
                return boundary
        return 0

    @precondition(lambda self: bool(self._live(*(s for s in State if s not in (State.EVICTED,)))))
    @rule(data=st.data(), reason=st.sampled_from(["finished", "aborted", "preempted"]))
    def request_leaves(self, data: st.DataObject, reason: str) -> None:
        live = self._live(*(s for s in State if s is not State.EVICTED))
        request_id = data.draw(st.sampled_from(live))
        req = self.requests.pop(request_id)
        req.lifecycle.evict(reason)
        if reason == "preempted":
            # The scheduler will see it again: a fresh incarnation under the same id.
            self.requests[request_id] = FuzzRequest(
                self.machine.new_request(request_id), req.family, req.num_tokens, req.hashes
            )
