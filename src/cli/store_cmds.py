"""``hybridkv store ls|stats|clear|quota URL`` and ``hybridkv bench store``: argument parsing, printing and exit
codes over :mod:`hybridkv.ops.store_admin` (and, for the bench, :mod:`hybridkv.bench.store`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from hybridkv.cli.bench_options import add_report_arguments
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.ops import store_admin
from hybridkv.store import StoreError
from hybridkv.store.params import parse_size
from hybridkv.tables import format_table


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``store ls|stats|clear|quota`` to ``subparsers`` and ``store`` to ``bench_subparsers``."""
    store = subparsers.add_parser(
        "store",
        help="inspect or clear a store by URL",
        description="Every action refuses a URL that names no existing store (it never creates one). A "
        "file:// URL without capacity shows the capacity the store's engines recorded.",
    )
    store.set_defaults(func=lambda _args: _usage(store))
    store_subparsers = store.add_subparsers(dest="store_command", metavar="ACTION")
    actions: dict[str, argparse.ArgumentParser] = {}
    for name, handler, help_text in (
        ("ls", handle_ls, "list keys (optionally under a prefix)"),
        ("stats", handle_stats, "show keys, bytes, capacity and backend details"),
        (
            "clear",
            handle_clear,
            "remove the keys of one namespace (--namespace) or under --prefix; the whole store needs --yes",
        ),
    ):
        action = store_subparsers.add_parser(name, help=help_text, description=help_text)
        action.add_argument("url", metavar="URL", help="store URL, e.g. file:///dev/shm/hybridkv")
        action.add_argument("--json", action="store_true", help="print JSON instead of text")
        action.set_defaults(func=handler)
        actions[name] = action
    actions["ls"].add_argument("--prefix", default="", help="only keys starting with this")
    clear = actions["clear"]
    scope = clear.add_mutually_exclusive_group()
    scope.add_argument("--prefix", default="", help="only keys starting with this")
    scope.add_argument(
        "--namespace", metavar="NS", help="only the keys of namespace NS (every deployment keyed by it)"
    )
    clear.add_argument("--dry-run", action="store_true", help="count the keys that would go; remove nothing")
    clear.add_argument(
        "--yes", action="store_true", help="confirm clearing the whole store (no --namespace or --prefix)"
    )
    quota = store_subparsers.add_parser(
        "quota",
        help="show, set or clear the byte quotas per namespace (tenant) of a file store",
        description="A tenant (namespace) at its quota evicts its own least recently used entries to make "
        "room, never another tenant's; an entry larger than the quota is refused. The quotas live in the "
        "store's directory: every process sharing it enforces them from its next put.",
    )
    quota.add_argument("url", metavar="URL", help="file store URL, e.g. file:///dev/shm/hybridkv")
    quota.add_argument(
        "--set",
        dest="quotas_to_set",
        action="append",
        default=[],
        metavar="NS=SIZE",
        help="give namespace NS a quota of SIZE (e.g. team-a=20GiB; repeatable)",
    )
    quota.add_argument(
        "--clear",
        dest="namespaces_to_clear",
        action="append",
        default=[],
        metavar="NS",
        help="drop namespace NS's quota (repeatable)",
    )
    quota.add_argument("--json", action="store_true", help="print JSON instead of text")
    quota.set_defaults(func=handle_quota)

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
    bench.add_argument(
        "--parts",
        type=int,
        default=1,
        help="put every value from, and read it into, this many contiguous parts, as a block's KV pages "
        "are (one per layer): 16 for a 2 MiB block of 16 layers (%(default)s)",
    )
    bench.add_argument(
        "--readers",
        type=int,
        default=1,
        help="split every get over this many concurrent readers, each its own contiguous share of the "
        "keys, as a load job's readers split a hit; the memcpy floor stays one thread (%(default)s)",
    )
    add_report_arguments(bench, "bench-results/store.json")
    bench.set_defaults(func=handle_bench)


def _usage(parser: argparse.ArgumentParser) -> int:
    """``store`` without an action: the help on stderr, the usage exit code."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def handle_ls(args: argparse.Namespace) -> int:
    """``store ls URL [--prefix P] [--json]``: the deployments table and the keys; 2 for a bad store."""
    try:
        listing = store_admin.list_store(args.url, args.prefix)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(listing, indent=2))
    else:
        print(store_admin.render_listing(listing))
    return EXIT_OK


def handle_stats(args: argparse.Namespace) -> int:
    """``store stats URL [--json]``: the backend's stats; 2 for a bad store."""
    try:
        stats = store_admin.store_stats(args.url)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))
    else:
        print(store_admin.render_stats(stats))
    return EXIT_OK


def handle_clear(args: argparse.Namespace) -> int:
    """``store clear URL [--namespace NS | --prefix P] [--dry-run] [--yes] [--json]``: remove the keys (with
    ``--dry-run`` count them), say how many; 2 for a bad store, and for the whole store without ``--yes``
    (nothing removed; no prompt: scripts and CI have no terminal to answer it)."""
    try:
        prefix = args.prefix if args.namespace is None else store_admin.namespace_prefix(args.namespace)
        cleared = store_admin.clear_store(args.url, prefix, dry_run=args.dry_run, everything=args.yes)
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(cleared))
    else:
        print(store_admin.render_clear(cleared))
    return EXIT_OK


def handle_quota(args: argparse.Namespace) -> int:
    """``store quota URL [--set NS=SIZE]... [--clear NS]... [--json]``: the quotas after the change; 2 for a
    bad store or a bad quota (nothing written then)."""
    quotas_to_set: dict[str, int] = {}
    for assignment in args.quotas_to_set:
        namespace, sep, size_text = assignment.partition("=")
        if not sep or not namespace:
            print(f"error: --set {assignment!r}: expected NS=SIZE, e.g. team-a=20GiB", file=sys.stderr)
            return EXIT_USAGE
        try:
            quotas_to_set[namespace] = parse_size(size_text, what=f"--set {namespace}")
        except StoreError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_USAGE
    try:
        report = store_admin.store_quotas(
            args.url, quotas_to_set=quotas_to_set, namespaces_to_clear=args.namespaces_to_clear
        )
    except StoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(store_admin.render_quotas(report))
    return EXIT_OK


def _bench_sizes(
    args: argparse.Namespace, default_sizes: Sequence[int], default_bytes_per_round: int
) -> tuple[list[int], int]:
    """``--sizes`` and ``--bytes-per-round`` of ``hybridkv bench store`` (``--parts`` checked against the
    sizes, ``--readers`` against its range); StoreError for bad arguments."""
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
    if not 1 <= args.parts <= min(sizes):
        raise StoreError(f"--parts {args.parts}: need 1 to the smallest value size ({min(sizes)} bytes)")
    if not 1 <= args.readers <= 64:
        raise StoreError(f"--readers {args.readers}: need 1 to 64")
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
                num_parts=args.parts,
                num_readers=args.readers,
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
