"""The deadline on the file store's data calls, for file systems that may hang.

On a network or FUSE file system (NFS, CIFS, 9p, Ceph, sshfs, ...; anything ``hybridkv.store.file.mounts`` does
not know as local) a read or write blocks as long as the server or daemon does not answer, with a ``hard``
NFS mount forever -- and ``$XDG_CACHE_HOME``, where the default store lives, is often on NFS. There
``FileBackend`` (``hybridkv.store.file``, which picks the deadline) runs every data call (``exists``, put,
get, ``remove``) through a :class:`DeadlineGuard`, and every other call that touches the file system
(listing, ``remove_prefix``, ``stats``, the tenant counters the worker reads each step) through
:meth:`DeadlineGuard.call`, so that no file-system call of an engine thread or a reset waits past it.

Contract: with a deadline, :meth:`DeadlineGuard.run` runs the call on a ``DeadlineRunner`` thread and waits
at most ``timeout_ms``. A call past it answers ``TIMEOUT`` for all its keys and goes on in the runner's
thread, exactly like an abandoned Mooncake call: it registers its completion handle
(``hybridkv.store.base.register_late_call``) and ``answers_late`` is ``True``, so the worker never hands such
a call KV pages. :meth:`DeadlineGuard.call` (no buffers) raises ``StoreError`` past it instead, and the
call goes on likewise. Without one (a local file system) the call runs on the caller's thread -- no deadline
thread, zero copies -- and ``answers_late`` is ``False``. Opening the store is never bounded.
:meth:`DeadlineGuard.shutdown` says whether a call is still running, so that ``close`` leaves it the
descriptors it may still write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import structlog
from hybridkv.store.base import Status, StoreError, StoreLogEvent, register_late_call
from hybridkv.store.breaker import DeadlineExceeded, DeadlineRunner

log = structlog.get_logger(__name__)

T = TypeVar("T")


class DeadlineGuard:
    """Runs data calls under ``timeout_ms`` (``None``: no deadline, on the caller's thread). Thread-safe."""

    def __init__(self, *, url: str, fstype: str, timeout_ms: int | None) -> None:
        """``url`` and ``fstype`` name the store in the ``FILE_DEADLINE`` warning."""
        self.url = url
        self.fstype = fstype
        #: The deadline of each data call in ms, or ``None``: calls run on the caller's thread.
        self.timeout_ms = timeout_ms
        self._runner = None if timeout_ms is None else DeadlineRunner(name="hybridkv-file")
        #: Calls handed to the runner that have not returned yet, queued ones included (see ``shutdown``).
        self._num_runner_calls = 0
        self._lock = threading.Lock()

    @property
    def answers_late(self) -> bool:
        """Whether a call may answer ``TIMEOUT`` and go on (there is a deadline)."""
        return self._runner is not None

    @property
    def num_abandoned(self) -> int:
        """Calls that ran past their deadline so far."""
        return 0 if self._runner is None else self._runner.num_abandoned

    def run(self, op: str, num_keys: int, call: Callable[[], list[Status]]) -> list[Status]:
        """``call()``, under the deadline when there is one: past it, ``TIMEOUT`` for every key, and the
        call (still running, still using the caller's buffers) registered as late."""
        try:
            return self._under_deadline(call)
        except DeadlineExceeded as late:
            register_late_call(late.done)  # the call still owns the caller's buffers until it returns
            self._log_missed(op, num_keys)
            return [Status.TIMEOUT] * num_keys

    def call(self, op: str, call: Callable[[], T]) -> T:
        """``call()``'s result, under the deadline when there is one: past it raise ``StoreError`` naming
        ``op`` and the deadline, and let the call go on in the runner's thread (counted by ``shutdown``).
        For the calls that hand the store no buffers (listing, removal by prefix, statistics)."""
        try:
            return self._under_deadline(call)
        except DeadlineExceeded:
            self._log_missed(op, 0)
            raise StoreError(
                f"file store {self.url!r}: {op} did not finish within timeout_ms={self.timeout_ms} "
                f"(file system {self.fstype}); it goes on in the background"
            ) from None

    def _under_deadline(self, call: Callable[[], T]) -> T:
        """``call()`` on the runner, counted until it returns (``shutdown``); ``DeadlineExceeded`` past the
        deadline. Without a deadline, ``call()`` on the caller's thread."""
        runner, timeout_ms = self._runner, self.timeout_ms
        if runner is None or timeout_ms is None:
            return call()

        def counted() -> T:
            try:
                return call()
            finally:
                with self._lock:
                    self._num_runner_calls -= 1

        with self._lock:
            self._num_runner_calls += 1
        return runner.run(counted, timeout_ms / 1000.0)

    def _log_missed(self, op: str, num_keys: int) -> None:
        log.warning(
            StoreLogEvent.FILE_DEADLINE,
            url=self.url,
            op=op,
            num_keys=num_keys,
            timeout_ms=self.timeout_ms,
            fstype=self.fstype,
        )

    def shutdown(self) -> bool:
        """Stop the runner (no new calls); ``True`` if no call handed to it is still running, so whatever
        the calls use may be closed. A call past its deadline on a hung file system may never return."""
        if self._runner is not None:
            self._runner.shutdown()
        with self._lock:
            return self._num_runner_calls == 0
