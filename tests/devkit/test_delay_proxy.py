"""``DelayProxy``: round trips pay twice the one-way delay, bytes arrive intact and in order, chunks are
pipelined (not one delay each), connections and the proxy close cleanly. Real sockets on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import pytest
from hybridkv_dev.devkit.delay_proxy import DelayProxy, DelayProxyProcess

SMALL_MESSAGE = b"m" * 64


class EchoServer:
    """Sends back what it reads, per connection, until EOF; then closes its side."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                while data := conn.recv(1 << 20):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        if self.listener.fileno() == -1:
            return
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def echo_server() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        assert chunk, f"connection closed after {len(data)} of {num_bytes} bytes"
        data += chunk
    return bytes(data)


def _echo_round_trips_s(port: int, num_round_trips: int) -> list[float]:
    """Seconds per echo of a small message, on one connection (its set-up not counted)."""
    with _connect(port) as sock:
        sock.sendall(SMALL_MESSAGE)  # warm up: the proxy connects to the target on accept
        _recv_exactly(sock, len(SMALL_MESSAGE))
        times = []
        for _ in range(num_round_trips):
            start = time.perf_counter()
            sock.sendall(SMALL_MESSAGE)
            assert _recv_exactly(sock, len(SMALL_MESSAGE)) == SMALL_MESSAGE
            times.append(time.perf_counter() - start)
        return times


def _echo_payload(port: int, payload: bytes, write_sizes: list[int]) -> tuple[bytes, float]:
    """Send ``payload`` in writes of ``write_sizes`` (cycled) while reading the echo to EOF."""
    with _connect(port) as sock:

        def send() -> None:
            offset, index = 0, 0
            while offset < len(payload):
                size = write_sizes[index % len(write_sizes)]
                sock.sendall(payload[offset : offset + size])
                offset, index = offset + size, index + 1
            sock.shutdown(socket.SHUT_WR)

        start = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        received = bytearray()
        while chunk := sock.recv(1 << 20):
            received += chunk
        elapsed_s = time.perf_counter() - start
        sender.join(30)
        return bytes(received), elapsed_s


def _proxy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("delay-proxy-")]


@pytest.mark.parametrize("delay_ms", [0.0, 5.0, 20.0])
def test_a_round_trip_pays_twice_the_delay(echo_server: EchoServer, delay_ms: float) -> None:
    direct_s = statistics.median(_echo_round_trips_s(echo_server.port, 40))
    with DelayProxy(echo_server.port, delay_ms=delay_ms) as proxy:
        proxied_s = _echo_round_trips_s(proxy.port, 40)
    delay_s = delay_ms / 1000
    assert min(proxied_s) >= 2 * delay_s, (
        f"a round trip took {min(proxied_s) * 1e3:.2f} ms < 2 x {delay_ms} ms"
    )
    # Slack for the proxy's own hops and thread wake-ups on a busy 2-core host (a few ms at load 15); a
    # chunk delayed twice adds >= 2 x delay_ms, beyond it.
    slack_s = 0.004 + delay_s / 4
    assert statistics.median(proxied_s) < direct_s + 2 * delay_s + slack_s, (
        f"median round trip {statistics.median(proxied_s) * 1e3:.2f} ms through a {delay_ms} ms proxy "
        f"(direct {direct_s * 1e3:.2f} ms)"
    )


def test_bytes_arrive_intact_and_in_order_both_ways(echo_server: EchoServer) -> None:
    payload = os.urandom(24 << 20)
    with DelayProxy(echo_server.port, delay_ms=2.0) as proxy:
        # odd write sizes: chunk boundaries in the proxy fall anywhere
        received, _ = _echo_payload(proxy.port, payload, [1, 7, 65_537, 1 << 20, 3_333_333, 12])
        stats = proxy.stats()
    assert len(received) == len(payload), f"echoed {len(received)} of {len(payload)} bytes"
    assert received == payload, "bytes changed or reordered through the proxy"
    assert stats.num_bytes_to_target == len(payload) and stats.num_bytes_to_client == len(payload), stats
    assert stats.num_connections == 1 and stats.num_failed_connections == 0, stats


def test_chunks_are_pipelined_not_delayed_one_after_another(echo_server: EchoServer) -> None:
    """256 writes through a 100 ms proxy: one delay each way in total, not one per chunk."""
    delay_ms = 100.0
    payload = os.urandom(16 << 20)
    with DelayProxy(echo_server.port, delay_ms=delay_ms) as proxy:
        received, elapsed_s = _echo_payload(proxy.port, payload, [64 << 10])
    assert received == payload
    assert elapsed_s >= 2 * delay_ms / 1000
    # one delay per chunk would take >= 256 x 0.2 s here; the data itself moves in well under a second
    assert elapsed_s < 3.0, f"16 MiB through a {delay_ms} ms proxy took {elapsed_s:.2f} s: not pipelined"


def test_half_close_refusal_and_close(echo_server: EchoServer) -> None:
    baseline_threads = _proxy_threads()
    with DelayProxy(echo_server.port, delay_ms=10.0) as proxy:
        proxy_port = proxy.port
        # half-close: the echo server sees EOF (after the delay), answers, closes; the client reads EOF
        with _connect(proxy.port) as sock:
            sock.sendall(b"last words")
            sock.shutdown(socket.SHUT_WR)
            assert _recv_exactly(sock, 10) == b"last words"
            assert sock.recv(1) == b"", "EOF not forwarded"
        deadline = time.monotonic() + 5
        while proxy.stats().num_open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.stats().num_open_connections == 0, proxy.stats()
        # close() with a connection open: the client sees its connection end, no thread is left
        idle = _connect(proxy.port)
        idle.sendall(SMALL_MESSAGE)
        assert _recv_exactly(idle, len(SMALL_MESSAGE)) == SMALL_MESSAGE
        assert proxy.stats().num_open_connections == 1
        proxy.close()
        assert idle.recv(1) == b"", "the open connection survived close()"
        idle.close()
        stats = proxy.stats()
        assert stats.num_connections == 2 and stats.num_open_connections == 0, stats
        proxy.close()  # idempotent
    assert _proxy_threads() == baseline_threads, f"threads left: {_proxy_threads()}"
    with pytest.raises(ConnectionRefusedError):
        _connect(proxy_port)

    # a target that refuses: the client's connection is closed, counted as failed
    closed_port = echo_server.port
    echo_server.close()
    with DelayProxy(closed_port, delay_ms=1.0) as proxy, _connect(proxy.port) as sock:
        assert sock.recv(1) == b""
        assert proxy.stats().num_failed_connections == 1


def test_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        DelayProxy(50051, delay_ms=1.0, listen_host="0.0.0.0")
    with pytest.raises(ValueError, match="loopback only"):
        DelayProxy(50051, delay_ms=1.0, target_host="10.0.0.1")
    with pytest.raises(ValueError, match="delay_ms"):
        DelayProxy(50051, delay_ms=-1.0)
    with pytest.raises(ValueError, match="delay_ms"):
        DelayProxy(50051, delay_ms=float("nan"))


def test_the_proxy_in_its_own_process(echo_server: EchoServer) -> None:
    delay_ms = 5.0
    with DelayProxyProcess(echo_server.port, delay_ms=delay_ms) as proxy:
        assert proxy.address.startswith("127.0.0.1:")
        round_trips_s = _echo_round_trips_s(proxy.port, 20)
        payload = os.urandom(4 << 20)
        received, _ = _echo_payload(proxy.port, payload, [100_000])
    stats = proxy.close()
    assert min(round_trips_s) >= 2 * delay_ms / 1000
    assert received == payload
    assert stats is not None, "the proxy process printed no final counters"
    expected_bytes = (21 * len(SMALL_MESSAGE)) + len(payload)
    assert stats.num_bytes_to_target == expected_bytes and stats.num_bytes_to_client == expected_bytes, stats
    assert stats.num_connections == 2 and stats.num_open_connections == 0, stats
