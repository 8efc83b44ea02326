"""``hybridkv store ls|stats|clear URL`` and ``hybridkv bench store``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from hybridkv.cli import add_report_arguments
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.connector.identity import parse_manifest_key, read_manifest
from hybridkv.lifecycle.keys import parse_block_key
from hybridkv.store import Store, StoreError, open_store
from hybridkv.store.params import parse_size
from hybridkv.tables import format_table


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``store ls|stats|clear`` to ``subparsers`` and ``store`` to ``bench_subparsers``."""
    store = subparsers.add_parser("store", help="inspect or clear a store by URL")
    store.set_defaults(func=lambda _args: _usage(store))
    store_subparsers = store.add_subparsers(dest="store_command", metavar="ACTION")
    for name, handler, help_text in (
        ("ls", handle_ls, "list keys (optionally under a prefix)"),
        ("stats", handle_stats, "show keys, bytes, capacity and backend details"),
        ("clear", handle_clear, "remove every key (or every key under --prefix)"),
    ):
        action = store_subparsers.add_parser(name, help=help_text)
        action.add_argument("url", metavar="URL", help="store URL, e.g. file:///dev/shm/hybridkv")
        if name != "stats":
            action.add_argument("--prefix", default="", help="only keys starting with this")
        action.add_argument("--json", action="store_true", help="print JSON instead of text")
        action.set_defaults(func=handler)

    bench = bench_subparsers.add_parser(
        "store",
        help="put/get throughput per backend vs memcpy, exists latency",
        description="Put/get throughput of each store for several value sizes, next to a memcpy of the same "
        "bytes measured in the same run; p50/p99 latency of a one-key exists.",
    )
    bench.add_argument(
        "--store",
        dest="stores",
        action="append",
        metavar="URL",
        help="store URL to measure (repeatable; default: memory:// and file:// in a temp dir)",
    )
    bench.add_argument(
        "--sizes",
        default=None,
        help="comma-separated value sizes (default: the bench's, 64KiB,1MiB,16MiB)",
    )
    bench.add_argument(
        "--bytes-per-round",
        default=None,
        help="bytes moved per round (default: the bench's, 64MiB)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved rounds; ratios are their median and min-max (%(default)s)",
    )
    bench.add_argument(
        "--exists-calls", type=int, default=1000, help="exists calls for latency (%(default)s)"
    )
    add_report_arguments(bench, "bench-results/store.json")
    bench.set_defaults(func=handle_bench)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def handle_ls(args: argparse.Namespace) -> int:
    try:
        with open_store(args.url) as store:
            keys = sorted(store.iter_keys(args.prefix))
            deployments = _deployments(store, keys)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(
            json.dumps(
                {"url": args.url, "prefix": args.prefix, "deployments": deployments, "keys": keys}, indent=2
            )
        )
        return EXIT_OK
    if deployments:
        rows = [{name: _cell(row.get(name)) for name in _DEPLOYMENT_COLUMNS} for row in deployments]
        print(format_table(rows, _DEPLOYMENT_COLUMNS))
        print()
    print("\n".join(keys) if keys else f"(no keys under {args.prefix!r})")
    return EXIT_OK


_DEPLOYMENT_COLUMNS = [
    "namespace",
    "fingerprint",
    "num_keys",
    "model",
    "revision",
    "weights",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "tp",
    "dcp",
]


def _cell(value: object) -> object:
    return "-" if value is None or value == "" else value


def _deployments(store: Store, keys: list[str]) -> list[dict[str, Any]]:
    """One row per ``hkv1/<namespace>/<fingerprint>/`` among ``keys``: its number of block entries and its
    manifest's fields (model, weights identity, dtypes, geometry) when the engine that wrote it left one.
    Keys that are neither a block entry nor a manifest (another tool's) belong to no deployment."""
    num_keys: dict[tuple[str, str], int] = {}
    manifests: dict[tuple[str, str], str] = {}
    for key in keys:
        block = parse_block_key(key)
        if block is not None:
            deployment = (block.namespace, block.fingerprint)
            num_keys[deployment] = num_keys.get(deployment, 0) + 1
            continue
        manifest_of = parse_manifest_key(key)
        if manifest_of is not None:
            manifests[manifest_of] = key
    rows = []
    for deployment in sorted(num_keys.keys() | manifests.keys()):
        record = read_manifest(store, manifests[deployment]) if deployment in manifests else None
        row: dict[str, Any] = dict(record or {})
        row.update(namespace=deployment[0], fingerprint=deployment[1], num_keys=num_keys.get(deployment, 0))
        rows.append(row)
    return rows


def handle_stats(args: argparse.Namespace) -> int:
    try:
        with open_store(args.url) as store:
            stats = store.stats()
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    payload = dataclasses.asdict(stats)
    if args.json:
        print(json.dumps(payload, indent=2, sort_keys=True, default=str))
    else:
        extra = payload.pop("extra")
        rows = [{"field": name, "value": value} for name, value in {**payload, **extra}.items()]
        print(format_table(rows, ["field", "value"]))
    return EXIT_OK


def handle_clear(args: argparse.Namespace) -> int:
    try:
        with open_store(args.url) as store:
            num_removed = store.remove_prefix(args.prefix)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"url": args.url, "prefix": args.prefix, "num_removed": num_removed}))
    else:
        print(f"removed {num_removed} keys")
    return EXIT_OK


def _bench_sizes(
    args: argparse.Namespace, default_sizes: Sequence[int], default_bytes_per_round: int
) -> tuple[list[int], int]:
    """``--sizes`` and ``--bytes-per-round`` of ``hybridkv store bench``; StoreError for bad arguments."""
    size_texts = args.sizes.split(",") if args.sizes is not None else []
    sizes = [parse_size(text, what="value size") for text in size_texts if text.strip()]
    if args.sizes is None:
        sizes = list(default_sizes)
    bytes_per_round = (
        parse_size(args.bytes_per_round, what="--bytes-per-round")
        if args.bytes_per_round is not None
        else default_bytes_per_round
    )
    if not sizes or min(sizes) <= 0 or args.repeats < 1 or args.exists_calls < 2:
        raise StoreError("need at least one positive --sizes, --repeats >= 1 and --exists-calls >= 2")
    return sizes, bytes_per_round


def handle_bench(args: argparse.Namespace) -> int:
    from hybridkv.bench.report import save_report
    from hybridkv.bench.store import (
        DEFAULT_BYTES_PER_ROUND,
        DEFAULT_VALUE_SIZES,
        TABLE_COLUMNS,
        bench_scratch_dir,
        default_store_urls,
        plot_report,
        run_store_bench,
    )

    try:
        sizes, bytes_per_round = _bench_sizes(args, DEFAULT_VALUE_SIZES, DEFAULT_BYTES_PER_ROUND)
        with bench_scratch_dir() as scratch:
            urls = args.stores or default_store_urls(bytes_per_round, scratch)
            report = run_store_bench(
                urls,
                value_sizes=sizes,
                bytes_per_round=bytes_per_round,
                repeats=args.repeats,
                num_exists_calls=args.exists_calls,
            )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except AssertionError as error:  # a store returned a failure or wrong bytes during the bench
        print(f"problem: {error}", file=sys.stderr)
        return EXIT_PROBLEM
    print(format_table(report["rows"], TABLE_COLUMNS))
    save_report(report, args.out, plot_report, no_plot=args.no_plot)
    return EXIT_OK
