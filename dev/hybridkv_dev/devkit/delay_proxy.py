"""A loopback TCP proxy that adds a fixed one-way delay: network latency without ``tc netem``.

``DelayProxy(target_port, delay_ms=5)`` listens on ``127.0.0.1`` (a free port unless ``listen_port`` is
given) and forwards every connection it accepts to ``127.0.0.1:target_port``. Every chunk of bytes it reads
from either side is sent to the other side ``delay_ms`` after it was read, so:

- a request/response round trip through the proxy takes the direct round trip plus ``2 x delay_ms`` (what
  ``tc qdisc add dev lo root netem delay D`` gives on loopback, with ``D = delay_ms``), plus the proxy's own
  forwarding (tens of microseconds per hop on an idle host);
- bytes keep their order and arrive intact; each direction is delayed on its own;
- throughput is not limited: reading goes on while earlier chunks wait out their delay. Only memory is
  bounded: at most ``max_buffered_bytes`` per direction and connection wait in the proxy (the sender then
  waits for the receiver, as TCP flow control would make it); 64 MiB per 5 ms is ~13 GB/s, more than
  loopback carries.

Not modelled: connection set-up (a client's ``connect`` completes against the proxy at once and the proxy
connects to the target right away, so the TCP handshake pays no delay; the first bytes do), loss, jitter and
bandwidth limits. A delivery is never early; it is late by the time a thread takes to wake (tens of
microseconds on an idle host, more on a loaded one).

Threads, not an event loop: each direction of each connection has a receiving and a sending thread, and the
sender waits with ``time.sleep`` (``clock_nanosleep``: microsecond wake-ups; an asyncio loop rounds its
timers up to whole milliseconds). These are Python threads: a process whose other threads hold the GIL
(e.g. a benchmark's scheduler loop) delays them by up to the switch interval (5 ms). Measure such a process
through ``DelayProxyProcess``, the same proxy in a child process of its own
(``python -m hybridkv_dev.devkit.delay_proxy``).

Half-close is forwarded (EOF reaches the other side after the data before it, also delayed); a reset or
error on either side closes both. ``start()`` returns once the proxy accepts connections; ``close()`` (or
leaving the ``with`` block) stops accepting, closes every open connection (both sides) and joins the
threads. ``stats()`` counts connections and delivered bytes.

Loopback only: the listen and target hosts must be loopback addresses; anything else raises ``ValueError``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ipaddress
import json
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import IO, Self

__all__ = ["DelayProxy", "DelayProxyProcess", "DelayProxyStats", "read_child_line"]

_READ_CHUNK_BYTES = 1 << 20
_CONNECT_TIMEOUT_S = 5.0
_JOIN_TIMEOUT_S = 10.0
#: First line of ``python -m hybridkv_dev.devkit.delay_proxy``: ``listening HOST:PORT``.
LISTENING_PREFIX = "listening"
#: Last line, after SIGTERM/SIGINT: ``stats {json of DelayProxyStats}``.
STATS_PREFIX = "stats"


@dataclass(frozen=True)
class DelayProxyStats:
    """Counters since ``start()``. Bytes are counted when delivered (sent to the other side)."""

    num_connections: int
    """connections accepted"""
    num_open_connections: int
    """connections accepted and not yet closed"""
    num_failed_connections: int
    """connections closed at once because the target refused them"""
    num_bytes_to_target: int
    """bytes delivered client -> target"""
    num_bytes_to_client: int
    """bytes delivered target -> client"""


def _check_loopback(what: str, host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"delay proxy is loopback only: {what} {host!r} is not a loopback address")


def _check_delay_ms(delay_ms: float) -> None:
    if not delay_ms >= 0:  # also refuses NaN
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")


def _shutdown_quietly(sock: socket.socket, how: int) -> None:
    with contextlib.suppress(OSError):  # already closed or not connected: nothing to wake or end
        sock.shutdown(how)


class _Connection:
    """One accepted connection: two directions, each a receiving and a sending thread."""

    def __init__(self, proxy: DelayProxy, client: socket.socket, target: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.target = target
        self._lock = threading.Lock()
        self._aborted = False
        # Every thread of the connection, receivers included: the sockets are closed only once none of
        # them can still be blocked on one (a recv on a closed fd is never woken by a shutdown).
        self._num_threads_open = 4
        self.threads: list[threading.Thread] = []
        self.directions: list[_Direction] = []
        for source, destination, to_target in ((client, target, True), (target, client, False)):
            direction = _Direction(self, source, destination, to_target=to_target)
            self.directions.append(direction)
            name = f"delay-proxy-{proxy.target_port}-{'up' if to_target else 'down'}"
            self.threads.append(threading.Thread(target=direction.receive, name=name + "-recv", daemon=True))
            self.threads.append(threading.Thread(target=direction.send, name=name + "-send", daemon=True))

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Close both sides now (a reset, or the proxy closing): wakes every thread of this connection."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            # Under the lock: the sockets stay open (``thread_done`` closes them under it) until every
            # thread that could block on them has woken.
            for sock in (self.client, self.target):
                _shutdown_quietly(sock, socket.SHUT_RDWR)  # wakes threads in recv / sendall
        for direction in self.directions:
            direction.wake()  # and those waiting for bytes or for room

    def thread_done(self) -> None:
        """A receiving or sending thread ended; the last of the four closes the sockets."""
        with self._lock:
            self._num_threads_open -= 1
            last = self._num_threads_open == 0
            if last:
                self.client.close()
                self.target.close()
        if last:
            self.proxy._connection_closed()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), f"delay proxy thread {thread.name} did not stop"


class _Direction:
    """Bytes from ``source`` to ``destination``, each chunk held until ``delay`` after it was read."""

    def __init__(
        self, connection: _Connection, source: socket.socket, destination: socket.socket, *, to_target: bool
    ) -> None:
        self.connection = connection
        self.source = source
        self.destination = destination
        self.to_target = to_target
        self._changed = threading.Condition()
        # (deliver at, chunk) in reading order; b"" is EOF
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._num_buffered_bytes = 0

    def receive(self) -> None:
        try:
            self._receive()
        finally:
            self.connection.thread_done()

    def _receive(self) -> None:
        proxy = self.connection.proxy
        buffer = bytearray(_READ_CHUNK_BYTES)
        view = memoryview(buffer)
        while True:
            with self._changed:
                while self._num_buffered_bytes >= proxy.max_buffered_bytes and not self.connection.aborted:
                    self._changed.wait()
            if self.connection.aborted:
                return
            try:
                # recv_into + copy: recv(1 MiB) would allocate (and fault in) 1 MiB per call
                num_bytes = self.source.recv_into(buffer)
                chunk = bytes(view[:num_bytes])
            except OSError:
                self.connection.abort()
                return
            with self._changed:
                # stamped when read: the delay starts when the bytes reach the proxy
                self._queue.append((time.monotonic() + proxy.delay_s, chunk))
                self._num_buffered_bytes += len(chunk)
                self._changed.notify_all()
            if not chunk:
                return

    def send(self) -> None:
        try:
            while True:
                with self._changed:
                    while not self._queue and not self.connection.aborted:
                        self._changed.wait()
                    if self.connection.aborted:
                        return
                    deliver_at, chunk = self._queue.popleft()
                wait_s = deliver_at - time.monotonic()
                if wait_s > 0:
                    time.sleep(wait_s)
                if not chunk:
                    _shutdown_quietly(self.destination, socket.SHUT_WR)
                    return
                try:
                    self.destination.sendall(chunk)
                except OSError:
                    self.connection.abort()
                    return
                with self._changed:
                    self._num_buffered_bytes -= len(chunk)
                    self._changed.notify_all()
                self.connection.proxy._delivered(len(chunk), to_target=self.to_target)
        finally:
            self.connection.thread_done()

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class DelayProxy:
    """A TCP proxy on loopback that delays each direction by ``delay_ms``; see the module docstring."""

    def __init__(
        self,
        target_port: int,
        *,
        delay_ms: float,
        target_host: str = "127.0.0.1",
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        max_buffered_bytes: int = 64 << 20,
    ) -> None:
        _check_loopback("target host", target_host)
        _check_loopback("listen host", listen_host)
        _check_delay_ms(delay_ms)
        if not 0 < target_port < 65536:
            raise ValueError(f"bad target port {target_port}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"bad listen port {listen_port}")
        if max_buffered_bytes < _READ_CHUNK_BYTES:
            raise ValueError(f"max_buffered_bytes must be >= {_READ_CHUNK_BYTES}, got {max_buffered_bytes}")
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.delay_s = delay_ms / 1000.0
        self.max_buffered_bytes = max_buffered_bytes
        self._requested_listen_port = listen_port
        self._lock = threading.Lock()  # state and counters
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._connections: list[_Connection] = []
        self._started = False
        self._closed = False
        self._num_connections = 0
        self._num_open_connections = 0
        self._num_failed_connections = 0
        self._num_bytes_to_target = 0
        self._num_bytes_to_client = 0

    @property
    def delay_ms(self) -> float:
        return self.delay_s * 1000.0

    @property
    def port(self) -> int:
        """The port the proxy listens on (after ``start()``)."""
        assert self._listener is not None, "DelayProxy.port read before start()"
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def address(self) -> str:
        """``HOST:PORT`` to connect to instead of the target (after ``start()``)."""
        return f"{self.listen_host}:{self.port}"

    def start(self) -> Self:
        """Listen, and accept and forward in daemon threads; returns once connections are accepted.

        Raises ``OSError`` when the listen port cannot be bound. A second call is a no-op; a closed proxy
        cannot be started again (``RuntimeError``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DelayProxy was closed; make a new one")
            if self._started:
                return self
            listener = socket.socket(socket.AF_INET6 if ":" in self.listen_host else socket.AF_INET)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.listen_host, self._requested_listen_port))
                listener.listen(64)
            except OSError:
                listener.close()
                raise
            self._listener = listener
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name=f"delay-proxy-{self.target_port}-accept", daemon=True
            )
            self._accept_thread.start()
            self._started = True
            return self

    def stats(self) -> DelayProxyStats:
        with self._lock:
            return DelayProxyStats(
                num_connections=self._num_connections,
                num_open_connections=self._num_open_connections,
                num_failed_connections=self._num_failed_connections,
                num_bytes_to_target=self._num_bytes_to_target,
                num_bytes_to_client=self._num_bytes_to_client,
            )

    def close(self) -> None:
        """Stop accepting, close every open connection (both sides), join all threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, accept_thread = self._listener, self._accept_thread
            connections = list(self._connections)
        if listener is not None:
            _shutdown_quietly(listener, socket.SHUT_RDWR)  # wakes accept()
            listener.close()
        if accept_thread is not None:
            accept_thread.join(_JOIN_TIMEOUT_S)
            assert not accept_thread.is_alive(), "delay proxy accept thread did not stop"
        with self._lock:
            connections = list(self._connections)  # the accept loop may have added one meanwhile
        for connection in connections:
            connection.abort()
        for connection in connections:
            # senders that slept through the abort wake within one delay
            connection.join(_JOIN_TIMEOUT_S + self.delay_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        listen = f"{self.listen_host}:{self.port}" if self._listener is not None else "(not started)"
        return f"DelayProxy({listen} -> {self.target_host}:{self.target_port}, delay_ms={self.delay_ms:g})"

    # -- the proxy's threads ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None, "accept loop started before the listener"
        while True:
            try:
                client, _peer = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._num_connections += 1
                self._connections = [c for c in self._connections if any(t.is_alive() for t in c.threads)]
                if self._closed:
                    client.close()
                    return
            try:
                target = socket.create_connection((self.target_host, self.target_port), _CONNECT_TIMEOUT_S)
            except OSError:
                with self._lock:
                    self._num_failed_connections += 1
                client.close()
                continue
            target.settimeout(None)
            for sock in (client, target):
                # without it, Nagle holds a small write until the previous one is acknowledged
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(self, client, target)
            with self._lock:
                self._num_open_connections += 1
                self._connections.append(connection)
            connection.start()

    def _connection_closed(self) -> None:
        with self._lock:
            self._num_open_connections -= 1

    def _delivered(self, num_bytes: int, *, to_target: bool) -> None:
        with self._lock:
            if to_target:
                self._num_bytes_to_target += num_bytes
            else:
                self._num_bytes_to_client += num_bytes


class DelayProxyProcess:
    """The same proxy in a child process (``python -m hybridkv_dev.devkit.delay_proxy``): its threads do not
    wait for the GIL of the process being measured. ``start()`` returns once it listens; ``close()``
    stops it (SIGTERM) and returns its final ``DelayProxyStats``."""

    def __init__(
        self,
        target_port: int,
        *,
        delay_ms: float,
        target_host: str = "127.0.0.1",
        python: str = "",
        start_timeout_s: float = 30.0,
    ) -> None:
        _check_loopback("target host", target_host)
        _check_delay_ms(delay_ms)
        self.target_host = target_host
        self.target_port = target_port
        self.delay_ms = delay_ms
        self.python = python or sys.executable
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[str] | None = None
        self._address: str | None = None
        self._final_stats: DelayProxyStats | None = None

    @property
    def address(self) -> str:
        assert self._address is not None, "DelayProxyProcess.address read before start()"
        return self._address

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def start(self) -> Self:
        """Start the child and wait for its ``listening`` line; ``RuntimeError`` if it does not come."""
        assert self._process is None, "DelayProxyProcess started twice"
        argv = [
            self.python,
            "-m",
            "hybridkv_dev.devkit.delay_proxy",
            "--target-host",
            self.target_host,
            "--target-port",
            str(self.target_port),
            "--delay-ms",
            repr(self.delay_ms),
        ]
        self._process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = read_child_line(self._process.stdout, self.start_timeout_s)
        if not line.startswith(LISTENING_PREFIX + " "):
            self._stop()
            raise RuntimeError(
                f"delay proxy process did not start: {line!r} (exit {self._process.returncode})"
            )
        self._address = line.split()[1]
        return self

    def close(self) -> DelayProxyStats | None:
        """Stop the child; its final counters (``None`` if it died without printing them). Idempotent."""
        if self._process is not None and self._process.returncode is None:
            self._final_stats = self._stop()
        return self._final_stats

    def _stop(self) -> DelayProxyStats | None:
        process = self._process
        assert process is not None and process.stdout is not None
        stats = None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            rest, _ = process.communicate(timeout=_JOIN_TIMEOUT_S + self.delay_ms / 1000.0)
        except subprocess.TimeoutExpired:
            process.kill()
            rest, _ = process.communicate()
        for line in rest.splitlines():
            if line.startswith(STATS_PREFIX + " "):
                stats = DelayProxyStats(**json.loads(line[len(STATS_PREFIX) + 1 :]))
        return stats

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def read_child_line(stream: IO[str], timeout_s: float) -> str:
    """One line of a child's stdout, or "" when none came within ``timeout_s`` (or the child exited)."""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return ""
    return stream.readline().strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv_dev.devkit.delay_proxy",
        description="A loopback TCP proxy that delays each direction by a fixed time, until SIGTERM.",
    )
    parser.add_argument("--target-host", default="127.0.0.1", help="loopback address to forward to")
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    parser.add_argument("--listen-port", type=int, default=0, help="0: a free port (printed)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    try:
        proxy = DelayProxy(
            args.target_port,
            delay_ms=args.delay_ms,
            target_host=args.target_host,
            listen_port=args.listen_port,
        ).start()
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"{LISTENING_PREFIX} {proxy.address}", flush=True)
    stop.wait()
    proxy.close()
    print(f"{STATS_PREFIX} {json.dumps(asdict(proxy.stats()))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
