"""``mooncake://HOST:PORT?...``: Mooncake Store through ``MooncakeDistributedStore``'s pointer APIs.

One backend = one Mooncake client that mounts ``segment`` bytes of this process's DRAM into the pool
(embedded mode), or none with ``segment=0`` (a pure client of long-lived storage nodes, see
``hybridkv.store.mooncake_node``). Where puts go (``preferred_segment``):

- ``local`` (default): this client's own segment when it has one (placement on another client's segment
  goes over TCP, many times slower: docs/performance.md, "Figures behind design choices"); a pure client has
  none, so the master allocates.
- ``none``: the master allocates (``--allocation_strategy``, random by default) across mounted segments.
- ``HOST:PORT``: that segment (e.g. a storage node's hostname, as its ``ready`` line prints it).

Frames travel as scatter-gather lists (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``):
the small header part and the caller's payload buffers, without joining them. Over TCP only: none of those
buffers is registered with the transfer engine (``register_buffer``), which RDMA needs, so ``open_store``
refuses ``protocol=rdma``.

Every call runs through a ``CircuitBreaker`` and a ``DeadlineRunner`` (``timeout_ms`` must be > 0: without
a deadline a hung master would hold a request, and the worker thread loading it, forever): a dead
master (each call ~4.3 s, then -900) or a hung one (each call blocks until ``MC_RPC_TIMEOUT_MS``) costs at
most ``timeout_ms`` once; then calls fail fast with ``TRANSFER_FAILED`` without touching Mooncake until
``breaker_reset_s`` has passed, when one probe call (preceded by the instant ``health_check``, both under the
deadline) may close it; a probe that fails in any way, raising or hanging included, reopens it.

A call abandoned at its deadline keeps running inside Mooncake: a ``get_into`` may still write its
destinations, a ``put`` still read its values, after ``TIMEOUT`` was returned, until Mooncake's own timeout
(``MC_RPC_TIMEOUT_MS``, set to ``timeout_ms`` when unset) ends it. The backend keeps the buffers referenced
until then and registers the call's completion handle (``hybridkv.store.base.register_late_call``), so a
caller that collects it keeps those buffers out of use until the call has returned;
``stats().extra["num_abandoned_calls"]`` counts such calls.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import structlog
from hybridkv.store.base import Status, StoreError, StoreLogEvent, StoreStats, register_late_call
from hybridkv.store.breaker import Admission, CircuitBreaker, DeadlineExceeded, DeadlineRunner
from hybridkv.store.framed import FrameParts

log = structlog.get_logger(__name__)

#: Mooncake ``ErrorCode`` values this backend interprets (mooncake-store/include/types.h).
MOONCAKE_ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
#: Codes that mean "the master is unreachable": they count against the circuit breaker.
_MASTER_DOWN_CODES = frozenset({-900, -901})

_env_lock = threading.Lock()


def mooncake_error_name(code: int) -> str:
    return MOONCAKE_ERROR_NAMES.get(code, f"ERROR_{code}")


def status_of_code(code: int, op: str) -> Status:
    """Map one negative Mooncake code to a ``Status`` for operation ``op`` (put, get, exists, remove)."""
    if code in (-704, -703):
        # -703: a put of this key is still in flight; the key is not published yet (atomic publish).
        return Status.NOT_FOUND
    if code == -705:
        return Status.OK  # insert-if-absent: already stored
    if code == -200:
        return Status.NO_SPACE
    if code == -901:
        return Status.TIMEOUT
    if code == -801:
        return Status.CORRUPT
    if code == -600 and op == "get":
        # After a good setup, get_into's INVALID_PARAMS means "destination smaller than the object":
        # the stored frame is not the size the reader expects.
        return Status.CORRUPT
    return Status.TRANSFER_FAILED


def _address(part: memoryview) -> int:
    return int(np.frombuffer(part, dtype=np.uint8).ctypes.data)


def _scatter_gather(
    frames: Sequence[FrameParts],
) -> tuple[list[FrameParts], list[list[int]], list[list[int]]]:
    """Each frame's non-empty parts, with their addresses and sizes (Mooncake's multi-buffer arguments)."""
    nonempty = [[part for part in frame if part.nbytes] for frame in frames]
    addresses = [[_address(part) for part in frame] for frame in nonempty]
    sizes = [[part.nbytes for part in frame] for frame in nonempty]
    return nonempty, addresses, sizes


#: Keys per ``batch_is_exist`` call: the longest the binding holds the GIL converting keys and codes (a
#: 16,384-key lookup in 2,048-key slices: other threads' p99 wait for the GIL 0.34 ms instead of 1.6 ms, for
#: 4.05 ms instead of 2.96 ms per lookup; 1,024 keys: 0.27 ms for 4.7 ms).
EXISTS_KEYS_PER_CALL = 2048

#: ``batch_is_exist`` codes that are answers, not errors.
_EXISTS_STATUS: dict[int | Status, Status] = {1: Status.OK, 0: Status.NOT_FOUND}


def _ok_if_not_negative(_index: int, _key: str, code: int) -> Status | None:
    """Put and remove: any non-negative code is success."""
    return Status.OK if code >= 0 else None


class MooncakeBackend:
    """Frames in Mooncake Store; see the module docstring for placement, breaker and timeouts."""

    def __init__(
        self,
        url: str,
        master_address: str,
        *,
        metadata_server: str,
        local_hostname: str,
        segment_bytes: int,
        local_buffer_bytes: int,
        protocol: str,
        device: str,
        timeout_ms: int,
        breaker_failures: int,
        breaker_reset_s: float,
        preferred_segment: str,
    ) -> None:
        assert timeout_ms > 0, f"mooncake timeout_ms must be > 0 (open_store refuses it), got {timeout_ms}"
        self.url = url
        self.master_address = master_address
        self.timeout_ms = timeout_ms
        with _env_lock:
            # Mooncake reads MC_RPC_TIMEOUT_MS once per process; the first store opened sets it.
            current = os.environ.get("MC_RPC_TIMEOUT_MS")
            if current is None:
                os.environ["MC_RPC_TIMEOUT_MS"] = str(timeout_ms)
            elif current != str(timeout_ms):
                log.warning(
                    StoreLogEvent.MOONCAKE_RPC_TIMEOUT_ENV_DIFFERS, env=current, timeout_ms=timeout_ms
                )
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as error:  # includes a missing libibverbs.so.1
            raise StoreError(
                f"mooncake:// needs the Mooncake wheel (mooncake-transfer-engine-non-cuda on CPU hosts) and "
                f"libibverbs1: {error}"
            ) from None
        self._store: Any = MooncakeDistributedStore()
        code = self._store.setup(
            local_hostname,
            metadata_server,
            segment_bytes,
            local_buffer_bytes,
            protocol,
            device,
            master_address,
        )
        if code != 0:
            raise StoreError(
                f"mooncake store {url!r}: setup against master {master_address} failed with {code} "
                f"({mooncake_error_name(code)})"
            )
        self.hostname = str(self._store.get_hostname())
        self._config: Any = ReplicateConfig()
        if preferred_segment == "local":
            # "Own segment when it has one": a pure client (segment=0) mounts nothing, so naming its
            # hostname would make every put fail with NO_AVAILABLE_HANDLE; the master allocates instead.
            if segment_bytes > 0:
                self._config.preferred_segment = self.hostname
        elif preferred_segment != "none":
            self._config.preferred_segment = preferred_segment
        self.preferred_segment = str(self._config.preferred_segment)
        self._breaker = CircuitBreaker(num_failures_to_open=breaker_failures, reset_s=breaker_reset_s)
        self._runner = DeadlineRunner(name="hybridkv-mooncake")
        self._closed = False

    def _guarded(self, op: str, num_keys: int, call: Callable[[], list[int]]) -> list[int] | list[Status]:
        """Run ``call`` under the breaker and deadline. Returns raw codes, or final statuses on failure.

        Every way out of an admitted call reports to the breaker, so a half-open probe always gives its slot
        back: the probe's ``health_check`` runs with the call, inside the one deadline, and a check that
        hangs answers ``TIMEOUT``, one that reports the master down ``TRANSFER_FAILED``, and one that
        raises re-raises (as a raising call does), each after ``on_failure``."""
        admission = self._breaker.before_call()
        if admission is Admission.REJECT:
            return [Status.TRANSFER_FAILED] * num_keys
        guarded: Callable[[], list[int] | None] = call
        if admission is Admission.PROBE:
            guarded = functools.partial(self._probe, call)
        try:
            codes = self._runner.run(guarded, self.timeout_ms / 1000.0)
        except DeadlineExceeded as late:
            register_late_call(late.done)  # the call still owns the caller's buffers until it returns
            self._breaker.on_failure()
            log.warning(StoreLogEvent.MOONCAKE_DEADLINE, url=self.url, op=op, timeout_ms=self.timeout_ms)
            return [Status.TIMEOUT] * num_keys
        except BaseException:
            self._breaker.on_failure()  # never leave a half-open probe slot taken
            raise
        if codes is None:  # the probe found the master down
            self._breaker.on_failure()
            return [Status.TRANSFER_FAILED] * num_keys
        codes = list(map(int, codes))  # in C: an exists of thousands of keys holds the GIL while converting
        assert len(codes) == num_keys, f"mooncake {op} returned {len(codes)} codes for {num_keys} keys"
        down = sorted(_MASTER_DOWN_CODES.intersection(codes))
        if down:
            self._breaker.on_failure()
            log.warning(
                StoreLogEvent.MOONCAKE_MASTER_DOWN, url=self.url, op=op, code=mooncake_error_name(down[0])
            )
        else:
            self._breaker.on_success()
        return codes

    def _probe(self, call: Callable[[], list[int]]) -> list[int] | None:
        """The half-open probe, on a runner thread: ``None`` if ``health_check`` reports the master down (a
        dead master shows there at once, a hung one does not: then the deadline ends the probe), else
        ``call()``."""
        if self._store.health_check() == 2:
            return None
        return call()

    def answers_late(self, op: str) -> bool:
        """Always: every call runs under the deadline, and one past it answers ``TIMEOUT`` while it goes on
        inside Mooncake."""
        return True

    def _log_unexpected(self, op: str, key: str, code: int) -> None:
        if code not in (-704, -703, -200) and code not in _MASTER_DOWN_CODES:
            log.warning(
                StoreLogEvent.MOONCAKE_ERROR, url=self.url, op=op, key=key, code=mooncake_error_name(code)
            )

    def _statuses(
        self,
        op: str,
        keys: Sequence[str],
        codes: Sequence[int | Status],
        classify: Callable[[int, str, int], Status | None],
    ) -> list[Status]:
        """One status per key: breaker/deadline statuses as they are, else ``classify(index, key, code)``;
        a code it leaves (``None``) is an error, logged if unexpected and mapped by ``status_of_code``."""
        results: list[Status] = []
        for index, (key, code) in enumerate(zip(keys, codes, strict=True)):
            if isinstance(code, Status):
                results.append(code)
                continue
            status = classify(index, key, code)
            if status is None:
                self._log_unexpected(op, key, code)
                status = status_of_code(code, op)
            results.append(status)
        return results

    def exists(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)
        codes = self._guarded("exists", len(key_list), lambda: self._exists_in_slices(key_list))
        # A lookup asks thousands of keys at once: map the codes in C (a Python loop over them holds the GIL,
        # which the scheduler thread waits out; docs/performance.md, "Figures behind design choices");
        # anything unexpected (a breaker or deadline status, an error code) takes the logging path.
        statuses: list[Status | None] = list(map(_EXISTS_STATUS.get, codes))
        if None not in statuses:
            return cast(list[Status], statuses)
        return self._statuses("exists", key_list, codes, lambda _index, _key, code: _EXISTS_STATUS.get(code))

    def _exists_in_slices(self, keys: list[str]) -> list[int]:
        """``batch_is_exist`` over ``keys``, ``EXISTS_KEYS_PER_CALL`` at a time (one deadline for all).

        Why slices: the binding converts the whole key list and the codes while it holds the GIL (it lets it
        go only around the RPC), so one call of 16,384 keys kept every other thread of the engine waiting
        ~1.6 ms at p99 -- vLLM's scheduler thread among them (docs/performance.md, "Figures behind design
        choices").
        """
        codes: list[int] = []
        for start in range(0, len(keys), EXISTS_KEYS_PER_CALL):
            codes.extend(self._store.batch_is_exist(keys[start : start + EXISTS_KEYS_PER_CALL]))
        return codes

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        key_list = list(keys)
        nonempty, addresses, sizes = _scatter_gather(frames)
        # The closure references the parts, not only their addresses: an abandoned call goes on reading them
        # after this returns, and the header parts are FramedStore's, which nothing else keeps alive -- freed,
        # their memory would be reused and the late transfer would store other bytes as the header.
        codes = self._guarded(
            "put",
            len(key_list),
            lambda: (
                nonempty,
                self._store.batch_put_from_multi_buffers(key_list, addresses, sizes, self._config),
            )[1],
        )
        return self._statuses("put", key_list, codes, _ok_if_not_negative)

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        key_list = list(keys)
        nonempty, addresses, sizes = _scatter_gather(frames)
        codes = self._guarded(
            "get",
            len(key_list),
            lambda: (nonempty, self._store.batch_get_into_multi_buffers(key_list, addresses, sizes))[1],
        )

        def classify(index: int, key: str, code: int) -> Status | None:
            expected = sum(sizes[index])
            if code == expected:
                return Status.OK
            if code >= 0:
                return Status.CORRUPT  # stored object shorter than the destination
            if code == -800 and self._stored_size_differs(key, expected):
                # Mooncake reports a destination *larger* than the object as a transfer failure.
                return Status.CORRUPT
            return None

        return self._statuses("get", key_list, codes, classify)

    def _stored_size_differs(self, key: str, expected: int) -> bool:
        """Whether ``key`` is stored with a size other than ``expected`` (one extra RPC, failure path only)."""
        codes = self._guarded("get_size", 1, lambda: [self._store.get_size(key)])
        size = codes[0]
        return not isinstance(size, Status) and size >= 0 and size != expected

    def remove(self, keys: Sequence[str]) -> list[Status]:
        key_list = list(keys)
        # force=True: removal is invalidation (a corrupt or stale entry); it must not wait for read leases.
        codes = self._guarded("remove", len(key_list), lambda: self._store.batch_remove(key_list, True))
        return self._statuses("remove", key_list, codes, _ok_if_not_negative)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        raise StoreError(f"{self.url}: Mooncake Store cannot list keys (remove_prefix and stats still work)")

    def remove_prefix(self, prefix: str) -> int:
        pattern = "^" + re.escape(prefix)
        codes = self._guarded("remove_prefix", 1, lambda: [self._store.remove_by_regex(pattern, True)])
        code = codes[0]
        if isinstance(code, Status):
            raise StoreError(f"{self.url}: remove_prefix failed: {code.value} (circuit breaker or deadline)")
        if code < 0:
            raise StoreError(f"{self.url}: remove_prefix failed with {code} ({mooncake_error_name(code)})")
        return code

    def stats(self) -> StoreStats:
        """This client's settings and breaker, and the master's ``health_check`` answer, asked under the
        deadline: a hung master shows as ``"no answer within N ms"`` there (counted as an abandoned call)
        instead of holding the caller. Not a call of the breaker's: it neither opens nor closes it."""
        extra: dict[str, object] = {
            "master": self.master_address,
            "hostname": self.hostname,
            "preferred_segment": self.preferred_segment,
            "timeout_ms": self.timeout_ms,
        }
        extra.update(self._breaker.snapshot())
        if not self._closed:
            try:
                extra["health_check"] = int(
                    self._runner.run(self._store.health_check, self.timeout_ms / 1000.0)
                )
            except DeadlineExceeded:
                extra["health_check"] = f"no answer within {self.timeout_ms} ms"
        extra["num_abandoned_calls"] = self._runner.num_abandoned
        return StoreStats(url=self.url, extra=extra)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # close() unmounts this client's segment (~1 s); bounded in case the master is gone.
            self._runner.run(self._store.close, max(self.timeout_ms / 1000.0, 1.0) + 2.0)
        except DeadlineExceeded:
            log.warning(StoreLogEvent.MOONCAKE_CLOSE_TIMEOUT, url=self.url)
        self._runner.shutdown()
