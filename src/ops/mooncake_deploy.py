"""``hybridkv mooncake master|node|up``: a Mooncake deployment that outlives engines.

- master: ``mooncake_master`` with RPC and metrics bound to one address (no 0.0.0.0 where Mooncake lets us
  choose), the read lease and client TTL set, no HTTP metadata server (P2PHANDSHAKE): :func:`master_argv`,
  :func:`run_master`.
- node: a storage node mounting a DRAM segment in the pool: :func:`check_node`, then :func:`run_node`.
- up: both on this host, stopped together on SIGTERM / SIGINT: :class:`LocalDeployment`.

Every form gives engines a ``mooncake://`` URL (:func:`url_hints`) with :data:`ENGINE_HOST` to replace by
each engine host's own address (Mooncake advertises it to peers).

Contracts: input is checked before any process starts (:class:`hybridkv.store.StoreError` naming the bad
flag or value); nothing here prints -- the caller prints the hints and the outcome.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import FrameType, TracebackType
from typing import Self

from hybridkv.store import StoreError
from hybridkv.store.mooncake_node import (
    MIN_SEGMENT_BYTES,
    READY_PREFIX,
    _check_host,
    master_command,
    node_command,
    serve_storage_node,
)
from hybridkv.store.params import format_size, parse_size
from hybridkv.store.url import check_store_url

__all__ = [
    "ENGINE_HOST",
    "LocalDeployment",
    "check_node",
    "engine_url_hint",
    "master_argv",
    "run_master",
    "run_node",
    "segment_sizes",
    "url_hints",
]

#: Placeholder in the printed URL: each engine host puts its own reachable address there.
ENGINE_HOST = "ENGINE_HOST"

#: How long ``up`` gives the master before starting the node (it listens within ~0.2 s; the node retries).
_MASTER_HEAD_START_S = 1.0
_POLL_S = 0.2
_STOP_TIMEOUT_S = 10


def segment_sizes(segment: str, local_buffer: str) -> tuple[int, int]:
    """(segment bytes, local buffer bytes) from their texts (``4GiB``); ``StoreError`` naming ``--segment``
    or ``--local-buffer`` for a bad size or a segment below what Mooncake mounts."""
    segment_bytes = parse_size(segment, what="--segment")
    if segment_bytes < MIN_SEGMENT_BYTES:
        raise StoreError(
            f"bad --segment {segment!r}: Mooncake mounts at least {format_size(MIN_SEGMENT_BYTES)}"
        )
    return segment_bytes, parse_size(local_buffer, what="--local-buffer")


def master_argv(host: str, *, port: int, metrics_port: int, lease_ttl: str, client_ttl_s: int) -> list[str]:
    """The ``mooncake_master`` command line bound to ``host``; ``StoreError`` for a bad host or setting."""
    return master_command(
        host, port=port, metrics_port=metrics_port, lease_ttl=lease_ttl, client_ttl_s=client_ttl_s
    )


def engine_url_hint(master: str) -> str:
    """The store URL engines use against the master at ``master`` (``HOST:PORT``), as pure clients."""
    return f"mooncake://{master}?segment=0&local_hostname={ENGINE_HOST}&timeout_ms=2000"


def url_hints(master: str, metrics: str | None) -> list[str]:
    """The lines telling an operator what engines use: the store URL, how to fill in :data:`ENGINE_HOST`,
    and the master's metrics endpoint when ``metrics`` (``HOST:PORT``) is given."""
    lines = [
        f"store URL for engines: {engine_url_hint(master)}",
        f"  (replace {ENGINE_HOST} with each engine host's own address)",
    ]
    if metrics is not None:
        lines.append(f"master metrics: http://{metrics}/metrics")
    return lines


def run_master(argv: list[str]) -> int:
    """Run the master in the foreground; its exit status."""
    return subprocess.call(argv)


def check_node(master: str, host: str) -> None:
    """``StoreError`` naming ``--master`` (not HOST:PORT) or ``--host`` (empty, a wildcard such as 0.0.0.0,
    an IPv6 literal) of a storage node: checked before the caller prints anything, so that no URL hint is
    printed for a node that will not start."""
    try:
        check_store_url(f"mooncake://{master}")
    except StoreError:
        raise StoreError(f"bad --master {master!r}: expected the master's HOST:PORT") from None
    # The storage node's own rule (it checks again when it mounts): the address Mooncake advertises.
    _check_host("--host", host)


def run_node(master: str, host: str, *, segment_bytes: int, local_buffer_bytes: int) -> int:
    """Run a storage node in this process until it is stopped; its exit status."""
    return serve_storage_node(
        master, host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
    )


class LocalDeployment:
    """A master and a storage node on this host (``hybridkv mooncake up``).

    Built from checked settings (the constructor raises ``StoreError`` before any process starts). As a
    context manager: entering starts the master, gives it a head start, starts the node and makes SIGTERM
    and SIGINT request a stop (the handlers stay installed); leaving terminates whichever process still runs
    (killing one that does not stop within 10 s). Use :meth:`wait_ready`, then :meth:`wait_stopped`."""

    def __init__(
        self,
        host: str,
        *,
        port: int,
        metrics_port: int,
        lease_ttl: str,
        client_ttl_s: int,
        segment_bytes: int,
        local_buffer_bytes: int,
    ) -> None:
        self.master_address = f"{host}:{port}"
        self.metrics_address = f"{host}:{metrics_port}"
        self._master_argv = master_argv(
            host, port=port, metrics_port=metrics_port, lease_ttl=lease_ttl, client_ttl_s=client_ttl_s
        )
        self._node_argv = node_command(
            self.master_address, host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
        )
        self._master: subprocess.Popen[bytes] | None = None
        self._node: subprocess.Popen[str] | None = None
        self._stopping = False

    def __enter__(self) -> Self:
        self._master = subprocess.Popen(
            self._master_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(_MASTER_HEAD_START_S)
        self._node = subprocess.Popen(self._node_argv, stdout=subprocess.PIPE, text=True)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        return self

    def _request_stop(self, _signum: int, _frame: FrameType | None) -> None:
        self._stopping = True

    def wait_ready(self) -> str | None:
        """The storage node's address once it says it mounted its segment; None when it said anything else
        (it did not start: :meth:`node_exit_status` waits for its status)."""
        _, node = self._started()
        assert node.stdout is not None
        line = node.stdout.readline()
        if not line.startswith(READY_PREFIX):
            return None
        return line.split()[1]

    def node_exit_status(self) -> int:
        """Wait for the storage node to exit; its exit status."""
        return self._started()[1].wait()

    def wait_stopped(self) -> bool:
        """Wait until a stop is requested (True) or the master or the node exits (False)."""
        master, node = self._started()
        while not self._stopping and master.poll() is None and node.poll() is None:
            time.sleep(_POLL_S)
        return not (master.poll() is not None or node.poll() is not None)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for process in (self._node, self._master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(_STOP_TIMEOUT_S)

    def _started(self) -> tuple[subprocess.Popen[bytes], subprocess.Popen[str]]:
        """(master, node) once started; ``RuntimeError`` outside the ``with`` block."""
        if self._master is None or self._node is None:
            raise RuntimeError("LocalDeployment: use it as a context manager (`with LocalDeployment(...)`)")
        return self._master, self._node
