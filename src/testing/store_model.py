"""The store conformance machine's model: what a store may answer, given what the machine did to it.

``StoreModel`` holds, per key, every value a read may legally return and whether the key is certainly
stored, the retentions and the pins that must survive eviction, and checks each answer of the store against
them (a read, a put and its quota, ``exists`` / ``remove``, the pins, the tenants' usage). It runs no rule
itself: ``hybridkv.testing.store_fuzz.make_store_machine`` subclasses it with the rules, their draws
built from a ``StoreFuzzConfig`` (what it was asked, and the key pool derived from it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Status, Store
from hybridkv.store.retention import RETAIN_FRACTION
from hypothesis.stateful import RuleBasedStateMachine

__all__ = [
    "FAILURE_STATUSES",
    "FRAME_OVERHEAD",
    "FREE_TENANT",
    "LONG_TTL_S",
    "SHORT_TTL_S",
    "StoreFuzzConfig",
    "StoreModel",
    "key_pool",
]

#: The statuses of a call that failed (allowed only with injected failures).
FAILURE_STATUSES = frozenset({Status.TRANSFER_FAILED, Status.TIMEOUT})

#: The tenant without a quota whose keys the pool holds next to the quota'd ones.
FREE_TENANT = "free"
#: Bytes a frame adds to its value at most (header, key, checksum) for the pool's keys.
FRAME_OVERHEAD = 512
#: Retention TTLs the machine draws: one that outlives any example, one that runs out within it.
LONG_TTL_S = 600.0
SHORT_TTL_S = 0.05


def key_pool(max_value_size: int, tenants: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """The keys the machine uses, each with its fixed value size; prefixes exercise ``remove_prefix``;
    ``tenants`` adds keys ``hkv1/<tenant>/...`` of each."""
    sizes = sorted({0, 1, 33, min(1000, max_value_size), max_value_size})
    prefixes = ("a/", "b/", "ключ/", *(f"hkv1/{tenant}/" for tenant in tenants))
    return [(f"{prefix}{index}-{size}", size) for prefix in prefixes for index, size in enumerate(sizes)]


@dataclass(frozen=True, kw_only=True)
class StoreFuzzConfig:
    """What ``make_store_machine`` was asked (its arguments' meanings are in its docstring), and what it
    derived: the key pool with each key's value size, the pool's keys of each tenant under a quota, and
    whether pins are tracked (with ``check_pins``, and always under quotas)."""

    factory: Callable[[], Store]
    allows_eviction: bool
    allows_corruption: bool
    allows_failures: bool
    supports_listing: bool
    max_value_size: int
    num_writer_threads: int
    check_pins: bool
    set_quotas: Callable[[Store, Mapping[str, int]], None] | None
    peer: Callable[[Store], Store] | None
    tenant_quotas: dict[str, int]
    pool: tuple[tuple[str, int], ...]
    key_to_size: Mapping[str, int]
    tenant_to_keys: dict[str, frozenset[str]]
    tracks_pins: bool


class StoreModel(RuleBasedStateMachine):
    """The model of one example's store and the checks of its answers (no rules: see the module)."""

    config: ClassVar[StoreFuzzConfig]

    def __init__(self) -> None:
        super().__init__()
        self.store: Store = self.config.factory()
        # the handles puts go through, in turn (the store, and the self.config.peer's handle on it)
        self.handles: list[Store] = [self.store] + (
            [self.config.peer(self.store)] if self.config.peer is not None else []
        )
        self.num_puts = 0
        # whether the tenants' quotas are in force (set at open, or by set_quotas_mid_run)
        self.quotas_set = self.config.set_quotas is None
        # key -> every byte string that a read of the key may legally return
        self.possible: dict[str, set[bytes]] = {}
        # keys a put returned OK for and nothing removed since (meaningful without eviction)
        self.certain: set[str] = set()
        # retained keys (retain answered OK; not released or removed since) -> the end of the retention
        self.key_to_retained_until: dict[str, float] = {}
        # the retained keys that must survive: retained while all retentions fit the protected share,
        # and they have fitted since (once they did not, the store may have let any of them go)
        self.pinned: set[str] = set()
        # the store's capacity (read from its stats at the start when pins are tracked; none: unbounded)
        self.capacity_bytes: float = 0

    def teardown(self) -> None:
        for handle in reversed(self.handles):
            handle.close()

    def _next_handle(self) -> Store:
        handle = self.handles[self.num_puts % len(self.handles)]
        self.num_puts += 1
        return handle

    # -- what the store may answer ----------------------------------------------------------------

    def _check_failure_allowed(self, op: str, key: str, status: Status) -> None:
        assert status in FAILURE_STATUSES and self.config.allows_failures, (
            f"{op}({key!r}) returned {status} unexpectedly"
        )

    def _after_put(self, key: str) -> None:
        """A put of ``key`` may have evicted any other entry of its tenant (its quota), none of another."""
        tenant = namespace_of(key)
        if tenant in self.config.tenant_to_keys:
            self.certain -= self.config.tenant_to_keys[tenant]

    def _check_quota_answer(self, key: str, status: Status) -> None:
        tenant = namespace_of(key)
        if tenant not in self.config.tenant_quotas or status in FAILURE_STATUSES or not self.quotas_set:
            return
        size, quota = self.config.key_to_size[key], self.config.tenant_quotas[tenant]
        if size >= quota:
            assert status is Status.NO_SPACE, (
                f"put({key!r}) of {size} bytes returned {status}: tenant {tenant!r} has a quota of {quota}"
            )
        elif size + FRAME_OVERHEAD <= quota and not self.config.allows_eviction:
            assert status is not Status.NO_SPACE, (
                f"put({key!r}) of {size} bytes returned NO_SPACE within tenant {tenant!r}'s quota {quota}"
            )

    def _record_put(self, key: str, value: bytes, status: Status) -> None:
        self._check_quota_answer(key, status)
        if status is Status.OK:
            # Insert-if-absent: the old value stays. If the store were to overwrite, the next read
            # returns bytes not in `possible` and fails.
            if key in self.certain and not self.config.allows_eviction and value not in self.possible[key]:
                return
            self.possible.setdefault(key, set()).add(value)
            self.certain.add(key)
        elif status is Status.NO_SPACE:
            assert (
                self.config.allows_eviction
                or self.config.allows_failures
                or namespace_of(key) in self.config.tenant_quotas
            ), f"put({key!r}) returned NO_SPACE without a capacity"
        else:
            self._check_failure_allowed("put", key, status)
            self.possible.setdefault(key, set()).add(value)  # it may have landed

    def _check_read(self, key: str, status: Status, data: bytes | None) -> None:
        if status is Status.OK:
            assert key in self.possible, f"{key!r} read OK but was never put (or was removed)"
            assert data in self.possible[key], (
                f"{key!r} read OK with bytes that were never put under it "
                f"({len(data or b'')} bytes, expected one of {len(self.possible[key])} values)"
            )
        elif status is Status.NOT_FOUND:
            assert self.config.allows_eviction or key not in self.certain, (
                f"{key!r} is stored but read NOT_FOUND"
            )
            self._check_not_pinned("get_into", key)
            self.key_to_retained_until.pop(key, None)  # an entry not stored is not retained
        elif status is Status.CORRUPT:
            assert self.config.allows_corruption, f"{key!r} read CORRUPT without corruption injected"
        else:
            self._check_failure_allowed("get_into", key, status)

    def _put_values(self, batch: list[str], values: list[bytes], split: bool) -> None:
        # A split value is passed as two parts (scatter-gather), concatenated by the store.
        offered: list[bytes | list[memoryview | bytearray]] = [
            [memoryview(v)[: len(v) // 2], bytearray(v[len(v) // 2 :])] if split else v for v in values
        ]
        self._fit_tenant_pins(batch)
        statuses = self._next_handle().put(batch, offered)
        assert len(statuses) == len(batch), f"put returned {len(statuses)} results for {len(batch)} keys"
        for key in batch:
            self._after_put(key)
        for key, value, status in zip(batch, values, statuses, strict=True):
            self._record_put(key, value, status)
        for key, status in zip(batch, statuses, strict=True):  # a later key may evict an earlier one
            if status is Status.OK:
                self._after_put(key)
        self._check_tenants_within_quota(concurrent=False)

    def _check_presence(self, op: str, batch: list[str], statuses: list[Status]) -> list[bool]:
        """Check ``op``'s (``exists``, ``remove``) answers: ``OK`` only for a key put and not removed,
        ``NOT_FOUND`` never for a key certainly stored (unless the store may evict), anything else an
        allowed failure. Per key: whether the store answered (``OK`` or ``NOT_FOUND``)."""
        assert len(statuses) == len(batch), f"{op} returned {len(statuses)} results for {len(batch)} keys"
        answered: list[bool] = []
        for key, status in zip(batch, statuses, strict=True):
            if status is Status.OK:
                assert key in self.possible, f"{op}({key!r}) is OK but the key was never put or was removed"
            elif status is Status.NOT_FOUND:
                assert self.config.allows_eviction or key not in self.certain, (
                    f"{op}({key!r}) NOT_FOUND but it is stored"
                )
                self._check_not_pinned(op, key)
                self.key_to_retained_until.pop(key, None)  # an entry not stored is not retained
            else:
                self._check_failure_allowed(op, key, status)
            answered.append(status in (Status.OK, Status.NOT_FOUND))
        return answered

    def _remove(self, batch: list[str]) -> None:
        answered = self._check_presence("remove", batch, self.store.remove(batch))
        for key, gone in zip(batch, answered, strict=True):
            if gone:
                self.possible.pop(key, None)
            # (a failed remove: the key may or may not be gone)
            self.certain.discard(key)
            self._unpin(key)

    def _check_tenants_within_quota(self, *, concurrent: bool) -> None:
        """After every put (only a put can grow a tenant): each tenant within its quota -- exactly after
        a put from one thread (``concurrent=False``), within the values written at once otherwise."""
        if not self.config.tenant_quotas or not self.quotas_set:
            return
        tenants = self.store.stats().extra.get("tenants")
        tenant_quotas = self.config.tenant_quotas
        assert isinstance(tenants, dict) and set(tenants) == set(tenant_quotas), (
            f"{self.store.url}: stats name the tenants {tenants}, the store was opened with {tenant_quotas}"
        )
        slack = (
            self.config.num_writer_threads * (self.config.max_value_size + FRAME_OVERHEAD)
            if concurrent
            else 0
        )
        for tenant, quota in self.config.tenant_quotas.items():
            usage = tenants[tenant]["usage_bytes"]
            assert usage <= quota + slack, (
                f"{self.store.url}: tenant {tenant!r} holds {usage} bytes, quota {quota} (+{slack} slack)"
            )

    # -- retention: pins and quotas -----------------------------------------------------------------

    def _retained_bytes(self, tenant: str | None = None) -> int:
        """What the store may count as retained (an upper bound): every retention not known to be
        released, expired (with a margin) or gone with its entry; of ``tenant``'s keys only if given."""
        horizon = time.time() - SHORT_TTL_S
        return sum(
            self.config.key_to_size[key] + FRAME_OVERHEAD
            for key, until in self.key_to_retained_until.items()
            if until > horizon and (tenant is None or namespace_of(key) == tenant)
        )

    def _pinned(self) -> set[str]:
        """The keys that must survive eviction now (``self.pinned``) whose long TTL still runs."""
        now = time.time()
        return {key for key in self.pinned if self.key_to_retained_until[key] > now + LONG_TTL_S / 2}

    def _fit_pins(self, extra_bytes: int = 0) -> None:
        """Forget every pin once the retentions the store may count (``_retained_bytes``) may not fit
        the protected share, or not fit the capacity beside ``extra_bytes`` written at once."""
        retained = self._retained_bytes()
        if retained > RETAIN_FRACTION * self.capacity_bytes or retained + extra_bytes > self.capacity_bytes:
            self.pinned.clear()

    def _fit_tenant_pins(self, batch: list[str], num_writers: int = 1) -> None:
        """Retention yields to the quota: before a put of ``batch``, forget the pins of each tenant of
        the batch whose retentions (``_retained_bytes``) may not fit the protected share of its quota,
        or not fit the quota beside one entry of the batch (``num_writers`` of them written at once):
        that put may take them."""
        for tenant in {namespace_of(key) for key in batch} & self.config.tenant_quotas.keys():
            assert tenant is not None
            quota = self.config.tenant_quotas[tenant]
            retained = self._retained_bytes(tenant)
            largest = max(self.config.key_to_size[key] for key in batch if namespace_of(key) == tenant)
            if (
                retained > RETAIN_FRACTION * quota
                or retained + num_writers * (largest + FRAME_OVERHEAD) > quota
            ):
                self.pinned = {key for key in self.pinned if namespace_of(key) != tenant}

    def _check_not_pinned(self, op: str, key: str) -> None:
        assert key not in self._pinned(), (
            f"{op}({key!r}): NOT_FOUND, but it is retained for {LONG_TTL_S:g} s within the protected "
            f"share of the capacity ({len(self.key_to_retained_until)} keys retained)"
        )

    def _unpin(self, key: str) -> None:
        self.key_to_retained_until.pop(key, None)
        self.pinned.discard(key)

    def _retain(self, batch: list[str], ttl_s: float) -> None:
        until = time.time() + ttl_s if ttl_s else 0.0
        statuses = self.store.retain(batch, until)
        if not self.store.supports_retention:
            assert statuses == [Status.TRANSFER_FAILED] * len(batch), f"retain({batch}) -> {statuses}"
            return
        answered = self._check_presence("retain", batch, statuses)
        for key, status, known in zip(batch, statuses, answered, strict=True):
            if status is Status.OK and until:
                self.key_to_retained_until[key] = until
                if ttl_s == LONG_TTL_S and self.config.tracks_pins:
                    self.pinned.add(key)
                else:
                    self.pinned.discard(key)
            elif known:  # released, or not stored (a pin is not kept for a later put)
                self._unpin(key)
            # (an unanswered call: its pin is unknown; the machine does not check pins with failures)
        if self.config.tracks_pins:
            self._fit_pins()

    def _check_pins(self) -> None:
        pinned = sorted(self._pinned())
        if not pinned:
            return
        self._check_presence("exists", pinned, self.store.exists(pinned))
        if self.config.supports_listing:
            listed = set(self.store.iter_keys(""))
            missing = set(self._pinned()) - listed
            assert not missing, f"iter_keys('') misses pinned keys {sorted(missing)}"
        destinations = [bytearray(self.config.key_to_size[key]) for key in pinned]
        for key, status, destination in zip(
            pinned, self.store.get_into(pinned, destinations), destinations, strict=True
        ):
            self._check_read(key, status, bytes(destination))
