"""``hybridkv mooncake master|node|up`` and ``hybridkv bench crosshost``: argument parsing, printing and
exit codes over :mod:`hybridkv.ops.mooncake_deploy` (processes, signals, URL hints).

- ``master --host ADDR``: ``mooncake_master`` bound to ``ADDR``.
- ``node --master ADDR:PORT --host ADDR --segment 4GiB``: a storage node mounting that much DRAM.
- ``up --host ADDR --segment 4GiB``: both on this host; prints the store URL engines use, then waits
  (Ctrl-C / SIGTERM stops both).

Every form prints the ``mooncake://`` URL for engines, with ``ENGINE_HOST`` to replace by each engine
host's own address (Mooncake advertises it to peers).
"""

from __future__ import annotations

import argparse
import sys

from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.ops import mooncake_deploy
from hybridkv.store import StoreError
from hybridkv.store.mooncake_node import (
    DEFAULT_CLIENT_TTL_S,
    DEFAULT_LEASE_TTL,
    DEFAULT_METRICS_PORT,
    DEFAULT_RPC_PORT,
)
from hybridkv.tables import format_table


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
    """``mooncake`` without an action: the help on stderr, the usage exit code."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _print_urls(master: str, metrics: str | None) -> None:
    for line in mooncake_deploy.url_hints(master, metrics):
        print(line, flush=True)


def _master_argv(args: argparse.Namespace) -> list[str]:
    return mooncake_deploy.master_argv(
        args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        lease_ttl=args.lease_ttl,
        client_ttl_s=args.client_ttl,
    )


def handle_master(args: argparse.Namespace) -> int:
    """``mooncake master``: print the URL hints, run the master; its exit status (2 for bad input)."""
    try:
        argv = _master_argv(args)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    _print_urls(f"{args.host}:{args.port}", f"{args.host}:{args.metrics_port}")
    return mooncake_deploy.run_master(argv)


def handle_node(args: argparse.Namespace) -> int:
    """``mooncake node``: check every flag (2 for bad input, nothing printed on stdout), print the URL hint,
    serve a storage node; its exit status."""
    try:
        mooncake_deploy.check_node(args.master, args.host)
        segment_bytes, local_buffer_bytes = mooncake_deploy.segment_sizes(args.segment, args.local_buffer)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    _print_urls(args.master, None)
    return mooncake_deploy.run_node(
        args.master, args.host, segment_bytes=segment_bytes, local_buffer_bytes=local_buffer_bytes
    )


def handle_up(args: argparse.Namespace) -> int:
    """``mooncake up``: a master and a node on this host until SIGTERM / SIGINT (0); 1 when either does not
    start or exits; 2 for bad input."""
    try:
        segment_bytes, local_buffer_bytes = mooncake_deploy.segment_sizes(args.segment, args.local_buffer)
        deployment = mooncake_deploy.LocalDeployment(
            args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            lease_ttl=args.lease_ttl,
            client_ttl_s=args.client_ttl,
            segment_bytes=segment_bytes,
            local_buffer_bytes=local_buffer_bytes,
        )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    with deployment:
        node_address = deployment.wait_ready()
        if node_address is None:
            print(
                f"error: storage node did not start (exit {deployment.node_exit_status()})", file=sys.stderr
            )
            return EXIT_PROBLEM
        print(f"storage node {node_address} mounted {args.segment}", flush=True)
        _print_urls(deployment.master_address, deployment.metrics_address)
        if not deployment.wait_stopped():
            print("error: the master or the storage node exited", file=sys.stderr)
            return EXIT_PROBLEM
        return EXIT_OK


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
