"""``hybridkv mooncake master|node|up``: start a Mooncake deployment that outlives engines.

- ``master --host ADDR``: ``mooncake_master`` with RPC and metrics bound to ``ADDR`` (no 0.0.0.0 where
  Mooncake lets us choose), the read lease and client TTL set, no HTTP metadata server (P2PHANDSHAKE).
- ``node --master ADDR:PORT --host ADDR --segment 4GiB``: a storage node mounting that much DRAM.
- ``up --host ADDR --segment 4GiB``: both on this host; prints the store URL engines use, then waits
  (Ctrl-C / SIGTERM stops both).

Every form prints the ``mooncake://`` URL for engines, with ``ENGINE_HOST`` to replace by each engine
host's own address (Mooncake advertises it to peers).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from types import FrameType

from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.store import StoreError
from hybridkv.store.mooncake_node import (
    DEFAULT_CLIENT_TTL_S,
    DEFAULT_LEASE_TTL,
    DEFAULT_METRICS_PORT,
    DEFAULT_RPC_PORT,
    MIN_SEGMENT_BYTES,
    READY_PREFIX,
    master_command,
    node_command,
    serve_storage_node,
)
from hybridkv.store.params import format_size, parse_size
from hybridkv.tables import format_table

#: Placeholder in the printed URL: each engine host puts its own reachable address there.
ENGINE_HOST = "ENGINE_HOST"


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``mooncake master|node|up`` and ``bench crosshost``."""
    mooncake = subparsers.add_parser(
        "mooncake",
        help="start a Mooncake master / storage node for engines on other hosts",
        description="Start a Mooncake deployment that outlives engines: a master and storage nodes; engines "
        "on any host connect as pure clients (segment=0). See docs/operations.md.",
    )
    mooncake.set_defaults(func=lambda _args: _usage(mooncake))
    actions = mooncake.add_subparsers(dest="mooncake_command", metavar="ACTION")

    master = actions.add_parser("master", help="run mooncake_master bound to --host")
    _master_arguments(master)
    master.set_defaults(func=handle_master)

    node = actions.add_parser("node", help="run a storage node (a DRAM segment in the pool)")
    node.add_argument("--master", required=True, metavar="HOST:PORT", help="the master's RPC address")
    _node_arguments(node)
    node.set_defaults(func=handle_node)

    up = actions.add_parser("up", help="run a master and a storage node on this host")
    _master_arguments(up)
    _node_arguments(up, host=False)
    up.set_defaults(func=handle_up)

    bench = bench_subparsers.add_parser(
        "crosshost",
        help="external-hit TTFT through a Mooncake store on another host vs file store vs local hit",
        description="Run on an engine host against a running deployment (hybridkv mooncake up): TTFT of an "
        "external hit through STORE vs a local file:// store vs vLLM's own prefix cache, lookup and load "
        "round trips, bytes moved per hit token. One run; ratios.",
    )
    bench.add_argument("--store", required=True, metavar="URL", help="the engines' mooncake:// URL")
    bench.add_argument("--file-store", default=None, metavar="URL", help="baseline (default: a temp file://)")
    bench.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length (1000)")
    bench.add_argument("--prompts", type=int, default=5, help="distinct prompts; medians over them (5)")
    bench.add_argument("--models-dir", default=None, help="where the tiny random model is built")
    bench.add_argument("--out", default="bench-crosshost.json", help="JSON report path")
    bench.set_defaults(func=handle_bench)


def _master_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", required=True, help="address of this host that engines reach (not 0.0.0.0)")
    parser.add_argument("--port", type=int, default=DEFAULT_RPC_PORT, help=f"RPC port ({DEFAULT_RPC_PORT})")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus port ({DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--lease-ttl", default=DEFAULT_LEASE_TTL, help=f"read lease after a lookup ({DEFAULT_LEASE_TTL})"
    )
    parser.add_argument(
        "--client-ttl",
        type=int,
        default=DEFAULT_CLIENT_TTL_S,
        help=f"seconds before a silent node's segment is dropped ({DEFAULT_CLIENT_TTL_S})",
    )


def _node_arguments(parser: argparse.ArgumentParser, *, host: bool = True) -> None:
    if host:
        parser.add_argument("--host", required=True, help="address of this host that engines reach")
    parser.add_argument("--segment", required=True, help="DRAM this node contributes, e.g. 4GiB (min 16MiB)")
    parser.add_argument("--local-buffer", default="16MiB", help="the node's staging buffer (16MiB)")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _sizes(args: argparse.Namespace) -> tuple[int, int]:
    segment_bytes = parse_size(args.segment, what="--segment")
    if segment_bytes < MIN_SEGMENT_BYTES:
        raise StoreError(
            f"bad --segment {args.segment!r}: Mooncake mounts at least {format_size(MIN_SEGMENT_BYTES)}"
        )
    return segment_bytes, parse_size(args.local_buffer, what="--local-buffer")


def engine_url_hint(master: str) -> str:
    return f"mooncake://{master}?segment=0&local_hostname={ENGINE_HOST}&timeout_ms=2000"


def _print_urls(master: str, metrics: str | None) -> None:
    print(f"store URL for engines: {engine_url_hint(master)}", flush=True)
    print(f"  (replace {ENGINE_HOST} with each engine host's own address)", flush=True)
    if metrics is not None:
        print(f"master metrics: http://{metrics}/metrics", flush=True)


def _master_argv(args: argparse.Namespace) -> list[str]:
    return master_command(
        args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        lease_ttl=args.lease_ttl,
        client_ttl_s=args.client_ttl,
    )


def handle_master(args: argparse.Namespace) -> int:
    try:
        argv = _master_argv(args)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    _print_urls(f"{args.host}:{args.port}", f"{args.host}:{args.metrics_port}")
    return subprocess.call(argv)


def handle_node(args: argparse.Namespace) -> int:
    try:
        segment_bytes, local_buffer_bytes = _sizes(args)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    _print_urls(args.master, None)
    return serve_storage_node(
        args.master, args.host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
    )


def handle_up(args: argparse.Namespace) -> int:
    try:
        segment_bytes, local_buffer_bytes = _sizes(args)
        master_argv = _master_argv(args)
        node_argv = node_command(
            f"{args.host}:{args.port}",
            args.host,
            segment_bytes=segment_bytes,
            local_buffer_bytes=local_buffer_bytes,
        )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    master = subprocess.Popen(master_argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # the master listens within ~0.2 s; the node retries its connection anyway
    node = subprocess.Popen(node_argv, stdout=subprocess.PIPE, text=True)
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        assert node.stdout is not None
        line = node.stdout.readline()
        if not line.startswith(READY_PREFIX):
            print(f"error: storage node did not start (exit {node.wait()})", file=sys.stderr)
            return EXIT_PROBLEM
        print(f"storage node {line.split()[1]} mounted {args.segment}", flush=True)
        _print_urls(f"{args.host}:{args.port}", f"{args.host}:{args.metrics_port}")
        while not stopping and master.poll() is None and node.poll() is None:
            time.sleep(0.2)
        if master.poll() is not None or node.poll() is not None:
            print("error: the master or the storage node exited", file=sys.stderr)
            return EXIT_PROBLEM
        return EXIT_OK
    finally:
        for process in (node, master):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def handle_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridkv.bench.crosshost import run_crosshost_bench
    from hybridkv.bench.report import write_json

    try:
        report = run_crosshost_bench(
            args.store,
            file_url=args.file_store,
            models_dir=Path(args.models_dir) if args.models_dir else None,
            prompt_tokens=args.prompt_tokens,
            num_prompts=args.prompts,
        )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    summary = report["summary"]
    print(format_table([{"metric": k, "value": v} for k, v in summary.items()], ["metric", "value"]))
    print(f"wrote {write_json(args.out, report)}")
    return EXIT_OK
