"""A Mooncake deployment that outlives engines: a master, long-lived storage nodes, engines as clients.

Topology (what ``hybridkv mooncake`` starts and ``docs/operations.md`` describes)::

    host A: mooncake_master --rpc_address=A      (metadata only: which key lives where)
            storage node    --host A --segment N  (a process that mounts N bytes of DRAM into the pool)
    host B: vLLM engines with store=mooncake://A:PORT?segment=0&local_hostname=B

Engines are pure clients (``segment=0``): they own no memory in the pool, so their entries survive them and
a new engine process (or an engine on another host) finds them. The master places each put on a mounted
segment (``--allocation_strategy``, random by default); with one storage node that is the node.

A storage node is one ``MooncakeDistributedStore`` with a segment, kept alive until SIGTERM/SIGINT. When it
dies, the entries in its segment go with it (readers get transfer failures until the master's
``--client_ttl`` expires it, then misses); the master losing its state (restart) forgets every entry.

Everything here is plain functions over argv lists so that the CLI, the tests and the docs start the very
same processes. P2PHANDSHAKE mode: no metadata server; each client advertises ``local_hostname``, which
must be an address the other hosts can reach (not 127.0.0.1 across hosts).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.store.base import StoreError
from hybridkv.store.params import format_size, parse_size

DEFAULT_RPC_PORT = 50051
DEFAULT_METRICS_PORT = 9003
#: The read lease Mooncake grants on lookup: long enough to cover lookup -> load of one request; short so
#: that full stores can evict (leased objects are not evictable).
DEFAULT_LEASE_TTL = "2s"
#: Seconds without heartbeat before the master unmounts a dead node's segment (Mooncake's default: 10).
DEFAULT_CLIENT_TTL_S = 10
#: Mooncake refuses smaller segments (client_buffer_allocation.cpp: "Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: The ready line a storage node prints once its segment is mounted: ``ready <hostname> <segment bytes>``.
READY_PREFIX = "ready"


def binary(name: str) -> str:
    """Path of a Mooncake console script (``mooncake_master``): next to this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise StoreError(
            f"{name} not found next to {sys.executable} nor on PATH: install mooncake-transfer-engine-non-cuda"
        )
    return found


def master_command(
    host: str,
    *,
    port: int = DEFAULT_RPC_PORT,
    metrics_port: int = DEFAULT_METRICS_PORT,
    lease_ttl: str = DEFAULT_LEASE_TTL,
    client_ttl_s: int = DEFAULT_CLIENT_TTL_S,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``mooncake_master`` argv bound to ``host`` (RPC and Prometheus metrics on ``host``, nothing on 0.0.0.0
    that can be bound elsewhere), without the embedded HTTP metadata server (P2PHANDSHAKE needs none)."""
    _check_host("host", host)
    return [
        binary("mooncake_master"),
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={lease_ttl}",
        f"--client_ttl={client_ttl_s}",
        "--logtostderr",
        *extra_args,
    ]


def node_command(
    master: str, host: str, *, segment_bytes: int, local_buffer_bytes: int = 16 << 20, python: str = ""
) -> list[str]:
    """argv of a storage node (``python -m hybridkv.store.mooncake_node``) mounting ``segment_bytes``."""
    return [
        python or sys.executable,
        "-m",
        "hybridkv.store.mooncake_node",
        "--master",
        master,
        "--host",
        host,
        "--segment",
        format_size(segment_bytes),
        "--local-buffer",
        format_size(local_buffer_bytes),
    ]


def engine_store_url(master: str, engine_host: str, *, timeout_ms: int = 2000, segment_bytes: int = 0) -> str:
    """The store URL an engine on ``engine_host`` uses: a pure client unless ``segment_bytes`` > 0."""
    _check_host("engine host", engine_host)
    return (
        f"mooncake://{master}?segment={format_size(segment_bytes) if segment_bytes else 0}"
        f"&local_hostname={engine_host}&timeout_ms={timeout_ms}"
    )


def _check_host(what: str, host: str) -> None:
    if not host or host in ("0.0.0.0", "::") or ":" in host:
        raise StoreError(
            f"bad {what} {host!r}: give the address this host is reached at by the others (e.g. 10.0.0.5); "
            f"Mooncake advertises it to peers, so a wildcard cannot work"
        )


@dataclass
class StorageNode:
    """One mounted segment in this process (``close`` unmounts it; its entries vanish with it)."""

    store: Any
    hostname: str
    segment_bytes: int

    def close(self) -> None:
        self.store.close()


def open_storage_node(master: str, host: str, *, segment_bytes: int, local_buffer_bytes: int) -> StorageNode:
    """Mount ``segment_bytes`` of this process's DRAM into the pool of ``master``, advertised as ``host``."""
    _check_host("host", host)
    if segment_bytes < MIN_SEGMENT_BYTES:
        raise StoreError(
            f"bad segment {format_size(segment_bytes)}: Mooncake mounts at least {format_size(MIN_SEGMENT_BYTES)}"
        )
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as error:
        raise StoreError(f"the storage node needs the Mooncake wheel and libibverbs1: {error}") from None
    store: Any = MooncakeDistributedStore()
    code = store.setup(host, "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master)
    if code != 0:
        raise StoreError(f"storage node: setup against master {master} as {host} failed with {code}")
    return StorageNode(store=store, hostname=str(store.get_hostname()), segment_bytes=segment_bytes)


def serve_storage_node(master: str, host: str, *, segment_bytes: int, local_buffer_bytes: int) -> int:
    """Run a storage node until SIGTERM/SIGINT; print the ready line once mounted. Returns an exit code."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    try:
        node = open_storage_node(
            master, host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
        )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"{READY_PREFIX} {node.hostname} {node.segment_bytes}", flush=True)
    stop.wait()
    node.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.store.mooncake_node",
        description="A Mooncake storage node: mounts a DRAM segment into the pool until SIGTERM.",
    )
    parser.add_argument("--master", required=True, help="the master's RPC address, HOST:PORT")
    parser.add_argument("--host", required=True, help="the address other hosts reach this node at")
    parser.add_argument("--segment", required=True, help="memory to contribute, e.g. 4GiB")
    parser.add_argument("--local-buffer", default="16MiB", help="private staging buffer (default 16MiB)")
    args = parser.parse_args(argv)
    try:
        segment_bytes = parse_size(args.segment, what="--segment")
        local_buffer_bytes = parse_size(args.local_buffer, what="--local-buffer")
    except StoreError as error:
        parser.error(str(error))
    return serve_storage_node(
        args.master, args.host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
    )


if __name__ == "__main__":
    sys.exit(main())
