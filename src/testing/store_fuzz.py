"""Store conformance as a Hypothesis ``RuleBasedStateMachine``: check any ``Store`` against a dict model.

Usage (pytest)::

    from hybridkv.store import open_store
    from hybridkv.testing.store_fuzz import make_store_machine

    TestMyStore = make_store_machine(lambda: open_store("file:///tmp/x?capacity=64KiB"),
                                     allows_eviction=True).TestCase

Each example calls ``factory()`` for a fresh, empty store and ``close()``s it at the end. A chaos store
(``faulty+``) should use a fixed ``seed`` so that Hypothesis can replay a failing example. The machine puts,
gets, checks existence, removes (by key and prefix), lists, writes one key from several threads at once,
and reads with wrong-size destinations. The model tracks, per key, every value that may legally be stored
and whether the key is certainly present. The properties:

- A read that returns ``OK`` returns exactly one of the values put under that key -- never other bytes,
  never a removed key's bytes. This holds under eviction, injected failures and injected corruption.
- Insert-if-absent: once a key is certainly present, a put of other bytes does not change what is read.
- Without eviction, a key certainly present is never ``NOT_FOUND``; with eviction it may vanish.
- ``CORRUPT`` only where corruption is allowed or the destination size is wrong; ``TRANSFER_FAILED`` and
  ``TIMEOUT`` only where failures are allowed. A read into a destination of the wrong size is never ``OK``.
- ``stats()``: when both are known, bytes stay within capacity (plus the values written concurrently).
- ``retain`` answers like ``exists`` and changes neither what is stored nor what a read returns (a store
  that cannot retain answers ``TRANSFER_FAILED`` for every key).
- Pins (with ``check_pins``, for a capacity-bounded store that retains): retentions are drawn with
  a long TTL, a TTL that runs out within the example, or a release. While every entry retained and not
  released fits in ``RETAIN_FRACTION`` of the capacity, an entry retained for the long TTL is never
  evicted -- not by puts of any batch, not by writers of one key at once (as long as their values and the
  pins fit the capacity together) -- it reads back, ``exists`` and is listed until it is removed or
  released; an entry whose TTL ran out, or that was released, is ordinary again (it may go).
- Pins under quotas (with ``quotas``, on a store that retains): retention yields to the quota. A tenant's
  pin survives its tenant's puts while the tenant's retained entries fit in ``RETAIN_FRACTION`` of its
  quota and the entry being put fits in the quota beside them; a put that can make room only by evicting
  retained entries takes them (the one expiring first first) and is never refused for them. Pins of the
  tenant without a quota, and the capacity, follow the rule above.
- With ``quotas`` (``hybridkv.store.quotas``; the pool then holds keys of those tenants and of one without a
  quota): after every put each tenant's bytes are within its quota -- exactly after a put from one thread,
  whatever its batch (a batch of more bytes than the quota keeps only its newest values that fit), plus the
  values written concurrently after the concurrent writers -- so no put can push another tenant's entries
  out while its tenant is over its quota; a value at least as large as its tenant's quota is refused with
  ``NO_SPACE``; a put may evict only entries of its own tenant -- every other key certainly stored stays
  readable (with no capacity bound the machine checks it on every read, ``exists`` and listing).
- Quotas set mid-run (with ``set_quotas``): the store starts without quotas and a rule sets them on the live
  data (a file store's ``hybridkv store quota --set``). Before, a tenant is like any other; after it, the first
  put (of any tenant) may evict any tenant's entries and every put -- the first included -- leaves each
  tenant within its quota, however much it held when the quota came.
- Several handles (with ``peer``: a second handle on the same storage, as a second process on a file
  store's directory): puts alternate between the handles and the writers of one key use both, so the
  quota checks above hold across processes that share the tenants' accounting.

Every key has a fixed value size (derived from the key), so a size mismatch is never the model's doing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Status, Store
from hybridkv.store.retention import RETAIN_FRACTION
from hybridkv.testing.store_model import (
    FRAME_OVERHEAD,
    FREE_TENANT,
    LONG_TTL_S,
    SHORT_TTL_S,
    StoreFuzzConfig,
    StoreModel,
    key_pool,
)
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

__all__ = ["FREE_TENANT", "key_pool", "make_store_machine"]


def make_store_machine(
    factory: Callable[[], Store],
    *,
    allows_eviction: bool,
    allows_corruption: bool = False,
    allows_failures: bool = False,
    supports_listing: bool = True,
    max_value_size: int = 4096,
    num_writer_threads: int = 3,
    quotas: Mapping[str, int] | None = None,
    check_pins: bool = False,
    set_quotas: Callable[[Store, Mapping[str, int]], None] | None = None,
    peer: Callable[[Store], Store] | None = None,
) -> type[RuleBasedStateMachine]:
    """Build a conformance state machine for the stores ``factory`` returns.

    Args:
        factory: returns a fresh, empty store per example (the machine closes it).
        allows_eviction: entries may vanish on their own (a capacity-bounded store).
        allows_corruption: reads may return ``CORRUPT`` (e.g. ``faulty+...?corrupt=P``).
        allows_failures: calls may return ``TRANSFER_FAILED`` / ``TIMEOUT`` (e.g. ``faulty+...?get_fail=P``).
        supports_listing: ``iter_keys`` works (Mooncake cannot list keys).
        max_value_size: the largest value size in the key pool.
        num_writer_threads: writers of one key at once in the concurrency rule.
        quotas: the bytes per tenant the store was opened with (``None``: it has none).
        check_pins: check that pins survive eviction in a store that retains (``hybridkv.store.retention``)
            with a capacity (its ``stats().capacity_bytes``), and flood it. Not with injected failures or
            corruption (an unanswered call leaves a pin unknown). With ``quotas`` the pins are checked
            whether or not this is set (retention yields to the quota: see the module's docstring).
        set_quotas: with ``quotas``, the stores start without them (``factory`` sets none) and a rule calls
            ``set_quotas(store, quotas)`` once, mid-run.
        peer: opens another handle on the storage of the store it is given (closed with it); puts alternate
            between the two.
    """
    assert not (check_pins and (allows_failures or allows_corruption)), (
        "check_pins with injected faults: a failed call leaves a pin unknown"
    )
    assert not (quotas and (allows_failures or allows_corruption)), (
        "quotas with injected faults: a failed call leaves a pin unknown"
    )
    # Pins are tracked and checked with check_pins, and always under quotas.
    tracks_pins = check_pins or bool(quotas)
    tenant_quotas: dict[str, int] = dict(quotas or {})
    pool = tuple(key_pool(max_value_size, (*sorted(tenant_quotas), FREE_TENANT) if tenant_quotas else ()))
    tenant_to_keys: dict[str, frozenset[str]] = {}
    for pool_key, _size in pool:
        tenant = namespace_of(pool_key)
        if tenant in tenant_quotas:
            tenant_to_keys[tenant] = tenant_to_keys.get(tenant, frozenset()) | {pool_key}
    key_to_size = dict(pool)
    config = StoreFuzzConfig(
        factory=factory,
        allows_eviction=allows_eviction,
        allows_corruption=allows_corruption,
        allows_failures=allows_failures,
        supports_listing=supports_listing,
        max_value_size=max_value_size,
        num_writer_threads=num_writer_threads,
        check_pins=check_pins,
        set_quotas=set_quotas,
        peer=peer,
        tenant_quotas=tenant_quotas,
        pool=pool,
        key_to_size=key_to_size,
        tenant_to_keys=tenant_to_keys,
        tracks_pins=tracks_pins,
    )
    keys = st.sampled_from([key for key, _size in pool])
    if tenant_to_keys:  # half the draws from the tenants under a quota, so that they fill it often
        keys = st.one_of(st.sampled_from(sorted(set().union(*tenant_to_keys.values()))), keys)

    def value_for(draw_data: st.DataObject, key: str) -> bytes:
        size = key_to_size[key]
        return draw_data.draw(st.binary(min_size=size, max_size=size), label=f"value of {key}")

    class StoreMachine(StoreModel):
        """The rules: what the machine does to the store (the checks of its answers are ``StoreModel``'s)."""

        @initialize()
        def store_starts_empty(self) -> None:
            found = self.store.exists([key for key, _size in pool])
            stored = [key for (key, _size), status in zip(pool, found, strict=True) if status is Status.OK]
            assert not stored, f"factory gave a non-empty store: {stored}"
            for (key, _size), status in zip(pool, found, strict=True):
                if status is not Status.NOT_FOUND:
                    self._check_failure_allowed("exists", key, status)
            if tracks_pins:
                capacity = self.store.stats().capacity_bytes
                assert self.store.supports_retention and (capacity is not None or not check_pins), (
                    f"check_pins needs a store that retains and has a capacity: {self.store.url}"
                )
                self.capacity_bytes = float("inf") if capacity is None else capacity

        # -- rules ---------------------------------------------------------------------------------------

        @rule(data=st.data(), batch=st.lists(keys, min_size=1, max_size=4), split=st.booleans())
        def put(self, data: st.DataObject, batch: list[str], split: bool) -> None:
            self._put(data, batch, split)

        @precondition(lambda self: bool(tenant_to_keys))
        @rule(data=st.data(), split=st.booleans())
        def put_one_tenants_batch(self, data: st.DataObject, split: bool) -> None:
            """One put of several keys of one tenant under a quota, often more bytes than its whole quota:
            the tenant must end within its quota (the batch's newest values that fit)."""
            tenant = data.draw(st.sampled_from(sorted(tenant_to_keys)), label="tenant")
            batch = data.draw(st.permutations(sorted(tenant_to_keys[tenant])), label="batch")
            self._put(data, batch[: data.draw(st.integers(2, len(batch)), label="batch size")], split)

        def _put(self, data: st.DataObject, batch: list[str], split: bool) -> None:
            self._put_values(batch, [value_for(data, key) for key in batch], split)

        @rule(batch=st.lists(keys, min_size=1, max_size=4, unique=True), split=st.booleans())
        def get_into(self, batch: list[str], split: bool) -> None:
            destinations: list[bytearray | list[bytearray]] = []
            for key in batch:
                size = key_to_size[key]
                destinations.append(
                    [bytearray(size // 3), bytearray(size - size // 3)] if split else bytearray(size)
                )
            statuses = self.store.get_into(batch, destinations)
            assert len(statuses) == len(batch), (
                f"get_into returned {len(statuses)} results for {len(batch)} keys"
            )
            for key, destination, status in zip(batch, destinations, statuses, strict=True):
                data = b"".join(destination) if isinstance(destination, list) else bytes(destination)
                self._check_read(key, status, data)

        @rule(key=keys, delta=st.sampled_from([-1, 1, 17]))
        def get_into_wrong_size(self, key: str, delta: int) -> None:
            size = key_to_size[key] + delta
            if size < 0:
                return
            [status] = self.store.get_into([key], [bytearray(size)])
            assert status is not Status.OK, f"{key!r} read OK into a destination of the wrong size {size}"
            if status not in (Status.NOT_FOUND, Status.CORRUPT):
                self._check_failure_allowed("get_into(wrong size)", key, status)
            if status is Status.NOT_FOUND:
                assert allows_eviction or key not in self.certain, f"{key!r} is stored but read NOT_FOUND"

        @rule(batch=st.lists(keys, min_size=1, max_size=6))
        def exists(self, batch: list[str]) -> None:
            self._check_presence("exists", batch, self.store.exists(batch))

        @rule(
            batch=st.lists(keys, min_size=1, max_size=4, unique=True),
            ttl_s=st.sampled_from([0.0, SHORT_TTL_S, LONG_TTL_S]),
        )
        def retain(self, batch: list[str], ttl_s: float) -> None:
            """Retention changes neither presence nor bytes (``hybridkv.store.retention``); a store that
            cannot retain says ``TRANSFER_FAILED`` for every key. ``ttl_s`` 0 releases."""
            self._retain(batch, ttl_s)

        @precondition(lambda self: check_pins and bool(self.certain))
        @rule(data=st.data(), ttl_s=st.sampled_from([SHORT_TTL_S, LONG_TTL_S]))
        def retain_stored(self, data: st.DataObject, ttl_s: float) -> None:
            """Retain entries the machine put (most retains of random keys find nothing to retain)."""
            stored = sorted(self.certain)
            self._retain(
                data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=2, unique=True)), ttl_s
            )

        @precondition(lambda self: check_pins)
        @rule(data=st.data(), pin_first=st.booleans())
        def flood(self, data: st.DataObject, pin_first: bool) -> None:
            """Fresh puts of the pool's largest values, one by one, of keys not retained (removed first, so
            that every put writes): more bytes than the capacity, enough to evict everything that is not
            protected; then every pin is checked. ``pin_first``: put a smaller value and retain it for the
            long TTL before the flood."""
            if pin_first:
                key = data.draw(
                    st.sampled_from([k for k, size in pool if size < max_value_size]), label="pin"
                )
                self._remove([key])
                self._put(data, [key], split=False)
                self._retain([key], LONG_TTL_S)
            batch = [
                key for key, size in pool if size == max_value_size and key not in self.key_to_retained_until
            ]
            # Rounds of fresh puts until more than the whole capacity was written. The values are not drawn
            # (megabytes of draws overrun Hypothesis' buffer): one byte pattern per round and key, so that
            # reads still tell them apart.
            num_rounds = int(1 + self.capacity_bytes // max(1, len(batch) * max_value_size))
            for round_index in range(num_rounds if batch else 0):
                self._remove(batch)
                for key_index, key in enumerate(batch):
                    pattern = bytes([(round_index * len(batch) + key_index) % 251 + 1])
                    self._put_values([key], [pattern * key_to_size[key]], split=False)
            if self.key_to_retained_until:  # which retained entries are left (a pinned one must be)
                retained = sorted(self.key_to_retained_until)
                self._check_presence("exists", retained, self.store.exists(retained))
            self._check_pins()

        @precondition(lambda self: check_pins)
        @rule()
        def pinned_entries_are_listed_and_read(self) -> None:
            """Every pinned entry is still stored: ``exists``, listing and a read."""
            self._check_pins()

        @precondition(lambda self: not self.quotas_set)
        @rule()
        def set_quotas_mid_run(self) -> None:
            """The quotas come on the live data: the next put may evict any tenant's entries (down to its
            quota), except pins within the protected share of their tenant's quota."""
            assert set_quotas is not None
            set_quotas(self.store, tenant_quotas)
            self.quotas_set = True
            for tenant, quota in tenant_quotas.items():
                self.certain -= tenant_to_keys.get(tenant, set())
                if self._retained_bytes(tenant) > RETAIN_FRACTION * quota:
                    self.pinned = {key for key in self.pinned if namespace_of(key) != tenant}

        @rule(batch=st.lists(keys, min_size=1, max_size=3, unique=True))
        def remove(self, batch: list[str]) -> None:
            self._remove(batch)

        @rule(prefix=st.sampled_from(["a/", "b/", "ключ/", "a/0"]))
        def remove_prefix(self, prefix: str) -> None:
            num_removed = self.store.remove_prefix(prefix)
            matching_possible = {key for key in self.possible if key.startswith(prefix)}
            matching_certain = {key for key in self.certain if key.startswith(prefix)}
            assert num_removed <= len(matching_possible), (
                f"remove_prefix({prefix!r}) removed {num_removed} keys, at most {len(matching_possible)} exist"
            )
            assert allows_eviction or num_removed >= len(matching_certain), (
                f"remove_prefix({prefix!r}) removed {num_removed} keys, but {len(matching_certain)} are stored"
            )
            for key in matching_possible:
                self.possible.pop(key)
                self.certain.discard(key)
            for key in [key for key in self.key_to_retained_until if key.startswith(prefix)]:
                self._unpin(key)

        @precondition(lambda self: supports_listing)
        @rule(prefix=st.sampled_from(["", "a/", "ключ/"]))
        def iter_keys(self, prefix: str) -> None:
            listed = list(self.store.iter_keys(prefix))
            assert len(listed) == len(set(listed)), f"iter_keys({prefix!r}) repeats keys: {sorted(listed)}"
            assert all(key.startswith(prefix) for key in listed), f"iter_keys({prefix!r}) -> {sorted(listed)}"
            unknown = set(listed) - set(self.possible)
            assert not unknown, f"iter_keys({prefix!r}) lists keys never put or removed: {sorted(unknown)}"
            if not allows_eviction:
                missing = {key for key in self.certain if key.startswith(prefix)} - set(listed)
                assert not missing, f"iter_keys({prefix!r}) misses stored keys {sorted(missing)}"
            unlisted_pins = {key for key in self._pinned() if key.startswith(prefix)} - set(listed)
            assert not unlisted_pins, f"iter_keys({prefix!r}) misses pinned keys {sorted(unlisted_pins)}"

        @rule(data=st.data(), key=keys)
        def concurrent_writers_of_one_key(self, data: st.DataObject, key: str) -> None:
            values = [value_for(data, key) for _ in range(num_writer_threads)]
            if tracks_pins:
                # Writers at once may each pass the capacity check before any publishes: pins are kept
                # only while all their values and the retained entries fit the capacity together (and the
                # quota of their tenant).
                self._fit_pins(num_writer_threads * (key_to_size[key] + FRAME_OVERHEAD))
                self._fit_tenant_pins([key], num_writers=num_writer_threads)
            barrier = threading.Barrier(num_writer_threads)
            thread_statuses: list[Status | None] = [None] * num_writer_threads

            writers = [self._next_handle() for _ in range(num_writer_threads)]

            def write(index: int) -> None:
                barrier.wait()
                [thread_statuses[index]] = writers[index].put([key], [values[index]])

            threads = [threading.Thread(target=write, args=(i,)) for i in range(num_writer_threads)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            self._after_put(key)
            landed = [v for v, s in zip(values, thread_statuses, strict=True) if s is Status.OK]
            if key in self.certain and not allows_eviction:
                pass  # insert-if-absent: nothing new may land
            elif landed:
                self.possible.setdefault(key, set()).update(landed)
                self.certain.add(key)
            for value, status in zip(values, thread_statuses, strict=True):
                assert status is not None, f"a writer of {key!r} returned no status"
                if status is not Status.OK:
                    self._record_put(key, value, status)
            destination = bytearray(key_to_size[key])
            [status] = self.store.get_into([key], [destination])
            self._check_read(key, status, bytes(destination))
            self._check_tenants_within_quota(concurrent=True)

        @invariant()
        def bytes_within_capacity(self) -> None:
            stats = self.store.stats()
            if stats.capacity_bytes is None or stats.num_bytes is None:
                return
            # Concurrent writers may each pass the capacity check before any of them publishes.
            slack = num_writer_threads * (max_value_size + 256)
            assert stats.num_bytes <= stats.capacity_bytes + slack, (
                f"{stats.url}: {stats.num_bytes} bytes stored, capacity {stats.capacity_bytes} (+{slack} slack)"
            )

    StoreMachine.config = config
    StoreMachine.__name__ = StoreMachine.__qualname__ = "StoreMachine"
    return StoreMachine
