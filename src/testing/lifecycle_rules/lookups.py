"""The lookups of the lifecycle fuzz machine: new requests and their lookups (the probing search checked
against the full scan over the store as the search saw it), and hard rule 1 on every hit: the plan
restores the boundary for every group on every rank, from keys the store answered present."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.lifecycle.kinds import GroupKind, cdiv
from hybridkv.lifecycle.load import LoadPlan
from hybridkv.lifecycle.lookup import plan_lookup
from hybridkv.lifecycle.table import State
from hybridkv.testing.lifecycle_rules.model import FuzzRequest, LifecycleModel, family_hashes
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

__all__ = ["LookupRules"]


class LookupRules(LifecycleModel):
    """Rules that start requests and look them up; ``_lookup`` is also what the scenarios call."""

    @rule(data=st.data(), family=st.integers(0, 1))
    def new_request(self, data: st.DataObject, family: int) -> None:
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="num_tokens")
        request_id = f"req-{self.num_requests}"
        self.num_requests += 1
        hashes = family_hashes(family, num_tokens // self.geometry.hash_unit)
        self.requests[request_id] = FuzzRequest(
            self.machine.new_request(request_id), family, num_tokens, hashes
        )

    @precondition(
        lambda self: bool(
            self._live(State.NEW, State.MISS, State.PARTIAL_HIT, State.TRUNCATED, State.REFUSED)
        )
    )
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        request_id = data.draw(
            st.sampled_from(
                self._live(State.NEW, State.MISS, State.PARTIAL_HIT, State.TRUNCATED, State.REFUSED)
            )
        )
        req = self.requests[request_id]
        block = self.geometry.scheduler_block_size
        local = data.draw(st.integers(0, max(0, req.num_tokens - 1) // block), label="local_blocks") * block
        self._lookup(data, req, local, may_be_unavailable=True)

    def _lookup(self, data: st.DataObject, req: FuzzRequest, local: int, *, may_be_unavailable: bool) -> None:
        req.num_computed_tokens = local
        was_truncated = req.lifecycle.current is State.TRUNCATED
        was_refused = req.lifecycle.current is State.REFUSED
        # The connector's probing search (a few batched rounds), or the full scan; the search must
        # answer exactly what the full scan answers over the same store, holes included.
        probing = data.draw(st.booleans(), label="probing search")
        search = req.lifecycle.start_search(req.hashes, req.num_tokens, local)
        if search is None:
            assert was_truncated or was_refused, "a lookup was refused without a reason"
            assert req.lifecycle.current is State.REFUSED and not req.lifecycle.may_hit
            return
        if may_be_unavailable and data.draw(st.integers(0, 9)) == 0:
            req.lifecycle.lookup_unavailable("timeout")
            assert req.lifecycle.num_external_tokens == 0
            return
        # key -> present, as the store answered this lookup (through the fault patterns, gaps included)
        answered: dict[str, bool] = {}

        def exists(keys: Sequence[str]) -> list[bool]:
            found = self._exists(keys)
            answered.update(zip(keys, found, strict=True))
            return found

        if probing:
            found = search.run(exists)
            full = plan_lookup(
                self.scheme, req.hashes, req.num_tokens, local, max_boundary=search.max_boundary
            )
            # The store as the search saw it: its answers where it asked, the model where it did not.
            expected = full.resolve([answered.get(key, key in self.store) for key in full.keys])
            assert (found.boundary, found.plan) == (expected.boundary, expected.plan), (
                f"probing search found {found.boundary}, the full scan {expected.boundary}"
            )
            event(f"search: {search.num_round_trips} round trips")
            result = req.lifecycle.finish_search(found)
        else:  # the full scan: one exists of every candidate key, resolved by the lifecycle's rules
            candidates = plan_lookup(
                self.scheme, req.hashes, req.num_tokens, local, max_boundary=search.max_boundary
            )
            result = req.lifecycle.finish_search(candidates.resolve(exists(candidates.keys)))
        if self.faulty is not None:
            gapped = any(not found and key in self.store for key, found in answered.items())
            event(f"lookup through fault patterns: {'gapped' if gapped else 'whole'} answer")
        req.retrying = was_truncated
        geometry = self.geometry
        assert result.boundary % geometry.hit_alignment == 0, f"boundary {result.boundary} is not aligned"
        assert result.boundary <= max(0, req.num_tokens - 1), "the hit leaves no token to recompute"
        if req.cap is not None:
            assert result.boundary <= max(req.cap, 0) or not result.is_hit, (
                f"lookup after truncation returned {result.boundary} > truncated boundary {req.cap}"
            )
        event(("retry" if was_truncated else "lookup") + (": hit" if result.is_hit else ": miss"))
        if result.is_hit:
            assert result.plan is not None and result.boundary > local
            self._check_plan_restorable(req, result.plan, local, answered)
        else:
            assert req.lifecycle.num_external_tokens == 0

    def _check_plan_restorable(
        self, req: FuzzRequest, plan: LoadPlan, local: int, answered: Mapping[str, bool]
    ) -> None:
        """Hard rule 1: every group on every rank can restore the boundary from local + plan, each planned
        key being one the lookup's store ``answered`` present."""
        geometry = self.geometry
        boundary = plan.boundary
        planned = {(load.group_index, load.block_index): load for load in plan.loads}
        for load in plan.loads:
            assert load.block_hash == self.scheme.boundary_hash(req.hashes, load.key_boundary), (
                f"group {load.group_index} block {load.block_index}: key from another prefix (mixed-prefix state)"
            )
            for key in self._keys(load.group_index, load.key_boundary, req.hashes):
                assert key in self.store, f"planned key {key} does not exist: a hit some rank cannot restore"
                assert answered.get(key) is True, (
                    f"planned key {key} was not answered present: a hit past a gap in the exists answer"
                )
                assert key not in self.invalidated, f"planned key {key} was invalidated by a truncation"
        for g, (group, span) in enumerate(zip(geometry.groups, geometry.spans, strict=True)):
            if group.kind is GroupKind.FULL:
                for i in range(cdiv(boundary, span)):
                    if (i + 1) * span <= local:
                        continue
                    block = planned.get((g, i))
                    assert block is not None, (
                        f"full group {g}: block {i} of a {boundary}-token hit is not planned"
                    )
                    assert i * span < block.key_boundary <= (i + 1) * span, (
                        f"group {g}: entry {block} not in block {i}"
                    )
                    assert block.key_boundary >= min((i + 1) * span, boundary), (
                        f"group {g}: block {i} entry ends at {block.key_boundary} < hit {boundary}"
                    )
            elif group.kind is GroupKind.SLIDING_WINDOW:
                assert group.sliding_window is not None and boundary % span == 0
                needed = max(1, cdiv(group.sliding_window - 1, span))
                for i in range(max(0, boundary // span - needed), boundary // span):
                    assert (i + 1) * span <= local or (g, i) in planned, (
                        f"swa group {g}: window block {i} missing"
                    )
            else:
                # Always from the store, even when the local hit reaches this block: a recurrent state at
                # the local hit is never reused past it (what makes divergent local hits exact, where
                # vLLM's local full-attention hit runs past any local state).
                state = planned.get((g, cdiv(boundary, span) - 1))
                assert state is not None and state.key_boundary == boundary, (
                    f"mamba group {g}: no state exactly at {boundary} in block {cdiv(boundary, span) - 1}"
                )
