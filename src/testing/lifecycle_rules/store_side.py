"""The store side of the lifecycle fuzz machine: seeded fault patterns in front of the model store,
entries earlier requests saved, evictions, and save waves (with the ``BlockStored`` rule: an event names
only entries stored on every rank)."""

from __future__ import annotations

from hybridkv.lifecycle.kinds import GroupKind
from hybridkv.lifecycle.save import plan_save
from hybridkv.lifecycle.table import State
from hybridkv.testing.fault_patterns import fault_patterns, faulty_model_store
from hybridkv.testing.lifecycle_rules.model import LifecycleModel, family_hashes
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

__all__ = ["StoreRules"]


class StoreRules(LifecycleModel):
    """Rules that change the model store: faults in front of it, earlier saves, evictions, save waves."""

    # -- store faults ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def store_fault_patterns(self, data: st.DataObject) -> None:
        """Seeded positional faults in front of the store (gaps, tails, random gaps; a run of failed calls;
        scoped to some groups or ranks), or none: lookups, loads and save waves go through them from now."""
        if data.draw(st.booleans(), label="no store faults"):
            self.faulty = None
            return
        self._arm_fault_patterns(data)

    def _arm_fault_patterns(self, data: st.DataObject) -> None:
        patterns = data.draw(fault_patterns(self.geometry), label="fault patterns")
        self.faulty = faulty_model_store(self.store, patterns, data.draw(st.integers(0, 7), label="seed"))
        note(f"store faults: {self.faulty.url}")

    # -- store-side rules ----------------------------------------------------------------------------

    @rule(data=st.data(), family=st.integers(0, 2))
    def previous_request_saved(self, data: st.DataObject, family: int) -> None:
        """Entries some earlier request stored: per group a boundary set, per rank maybe missing."""
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="saved_tokens")
        hashes = family_hashes(family, num_tokens // self.geometry.hash_unit)
        partial = data.draw(st.booleans(), label="some_ranks_missing")
        for group in range(self.geometry.num_groups):
            for boundary in self._draw_boundaries(data, group, num_tokens):
                for key in self._keys(group, boundary, hashes):
                    if not partial or data.draw(st.booleans()):
                        self._store_add([key])

    @rule(data=st.data(), family=st.integers(0, 1))
    def previous_request_saved_everything(self, data: st.DataObject, family: int) -> None:
        """A complete save of an earlier prompt: every group's every boundary on every rank."""
        num_tokens = data.draw(st.integers(1, self.max_tokens), label="saved_tokens")
        unit = self.geometry.hash_unit
        hashes = family_hashes(family, num_tokens // unit)
        for group in range(self.geometry.num_groups):
            for boundary in range(unit, len(hashes) * unit + 1, unit):
                kind = self.geometry.groups[group].kind
                if (
                    kind is not GroupKind.MAMBA
                    and boundary % self.geometry.spans[group]
                    and boundary != len(hashes) * unit
                ):
                    continue  # attention groups store whole blocks and the prompt tail only
                self._store_add(self._keys(group, boundary, hashes))

    @precondition(lambda self: bool(self.store))
    @rule(data=st.data())
    def store_evicts_middle(self, data: st.DataObject) -> None:
        """A hole in the middle of a saved prefix (LRU eviction, a lost node): one entry of one group at
        an interior boundary, on some ranks or all, while the entries on both sides stay."""
        parts = data.draw(st.sampled_from(sorted(self.store))).split("/")
        group, block_hash = int(parts[3].removeprefix("g")), bytes.fromhex(parts[-1])
        ranks = [r.tp_rank for r in self.geometry.topology.ranks]
        lost = data.draw(st.lists(st.sampled_from(ranks), min_size=1, unique=True), label="ranks lost")
        self.store.difference_update(self.scheme.key(group, rank, block_hash) for rank in lost)

    @precondition(lambda self: bool(self.store))
    @rule(data=st.data())
    def store_evicts(self, data: st.DataObject) -> None:
        victims = data.draw(st.lists(st.sampled_from(sorted(self.store)), max_size=6, unique=True))
        self.store.difference_update(victims)

    # -- save waves -----------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def save_wave(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[request_id]
        group_to_boundaries = {
            g: self._draw_boundaries(data, g, req.num_tokens) for g in range(self.geometry.num_groups)
        }
        plan = plan_save(self.scheme, req.hashes, group_to_boundaries)
        self.num_waves += 1
        wave = self.machine.new_save_wave(request_id, self.num_waves, plan)
        if data.draw(st.integers(0, 4)) == 0:
            wave.drop()
            return
        wave.start_put()
        outcomes = {entry: data.draw(st.integers(0, 5)) > 0 for entry, _ in plan.entries}
        if self.faulty is not None:
            outcomes = self._put_through_patterns(plan.entries, outcomes)
        for entry, key in plan.entries:
            if outcomes[entry]:
                self._store_add([key])
        events = wave.finish_put(outcomes)
        event(f"save wave: {wave.state}")
        for block in events:
            keys = [
                self.scheme.key(block.group_index, r.tp_rank, block.block_hash)
                for r in self.geometry.topology.ranks
            ]
            assert all(key in self.store for key in keys), (
                f"BlockStored published for group {block.group_index} block {block.block_index} "
                "but not every rank's entry is stored"
            )
            self.events_published.append(tuple(keys))
        assert wave.current in (State.STORED, State.FAILED), f"wave ended in {wave.state}"
