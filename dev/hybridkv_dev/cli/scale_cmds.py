"""``hybridkv bench scale``: how the stores' costs grow with what they hold (``hybridkv_dev.bench.scale``)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.cli import add_report_arguments
from hybridkv.cli.exit_codes import ExitCode


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    """Add ``scale`` to ``bench_subparsers`` (no top-level commands)."""
    del subparsers
    scale = bench_subparsers.add_parser(
        "scale",
        help="how the file store's costs grow with its entries (open, lookup, get, put, eviction, stats, RSS)",
        description="Axis entries: a file store of N small entries (1 KiB values) for each N of --sizes, "
        "populated with the store's own put (timed); interleaved repeats time opening a store, a K3-like "
        "128K-token lookup's exists (5,757 keys in 2 calls), a get, the tenant counters, stats (O(N) by "
        "design), a put that overflows the capacity and the eviction pass; a child process gives the engine "
        "side's RSS. Prints medians, spreads, the load average and the targets met or missed (per-unit cost "
        "at the largest size within 1.5x of the smallest, opening <= 1 s per million entries, the same round "
        "trips); writes a JSON report and a PNG when matplotlib is present.",
    )
    scale.add_argument(
        "--axis",
        default="entries",
        choices=["entries", *_AXIS_HANDLERS],
        help="the axis (%(default)s); mooncake-entries: the same costs on a real mooncake_master "
        "(run it under scripts/netns-run); prompt-length: the external hit's load job at 1K-64K tokens "
        "against one memcpy of its bytes; shared / mooncake-shared: 1-4 engine processes saving and loading on one "
        "file store / one Mooncake cluster (mooncake-shared under scripts/netns-run)",
    )
    scale.add_argument(
        "--sizes",
        default=None,
        help="entries per store (prompt-length: tokens per prompt), comma-separated (default: "
        "10000,100000,1000000; prompt-length: 1024,4096,16384,65536)",
    )
    scale.add_argument("--repeats", type=int, default=5, help="interleaved repeats per size (%(default)s)")
    scale.add_argument(
        "--dir",
        default=None,
        help="folder for the stores (default: a new one under the temporary folder); check its free space "
        "first: each entry takes a file (about 4 KiB on disk)",
    )
    scale.add_argument("--keep", action="store_true", help="leave the stores on disk")
    scale.add_argument(
        "--value-kib",
        type=int,
        default=None,
        help="shared, mooncake-shared / concurrent: KiB per block (256 / 1024)",
    )
    scale.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="shared, mooncake-shared: blocks per save and load (8); concurrent: per hit (64)",
    )
    scale.add_argument(
        "--rounds", type=int, default=None, help="shared, mooncake-shared: save+load rounds per engine (40)"
    )
    add_report_arguments(scale, "bench-scale.json")
    scale.set_defaults(func=handle_scale)


def handle_scale(args: argparse.Namespace) -> int:
    """Run the axis, print its tables and targets, write the JSON (and the PNG)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale import format_scale_table, plot_report, run_entries_axis

    if args.axis in _AXIS_HANDLERS:
        return _AXIS_HANDLERS[args.axis](args)
    try:
        sizes = [int(part) for part in (args.sizes or "10000,100000,1000000").split(",") if part.strip()]
    except ValueError:
        print(f"error: --sizes must be comma-separated integers, got {args.sizes!r}", flush=True)
        return ExitCode.USAGE
    if not sizes or min(sizes) < 2 or args.repeats < 1:
        print("error: --sizes must be >= 2 entries each and --repeats >= 1", flush=True)
        return ExitCode.USAGE
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hybridkv-scale-"))
    report = run_entries_axis(
        root, sizes, repeats=args.repeats, keep=args.keep, progress=lambda line: print(line, flush=True)
    )
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)  # the folder this command made
    load = ", ".join(f"{value:.2f}" for value in report["load_average_before"])
    load_after = ", ".join(f"{value:.2f}" for value in report["load_average_after"])
    print(
        f"file store, {report['value_bytes']} B values ({report['frame_bytes']} B frames), "
        f"{report['repeats']} interleaved repeats per size; load average {load} before, {load_after} after "
        f"({report['cpu_count']} cores)"
    )
    print(format_scale_table(report))
    if report["targets"]:
        print(format_targets(report["targets"]))
    save_report(report, args.out, plot_report, no_plot=args.no_plot)
    return ExitCode.OK


def _counts_or_usage(args: argparse.Namespace, default: str, what: str) -> list[int] | None:
    """``--sizes`` as counts of ``what`` (each at least 1), or None after printing the usage error (also for
    ``--repeats`` below 1)."""
    counts = _parse_sizes(args.sizes or default)
    if not counts or min(counts) < 1 or args.repeats < 1:
        print(f"error: --sizes must be {what} counts >= 1 and --repeats >= 1", flush=True)
        return None
    return counts


def _parse_sizes(text: str) -> list[int] | None:
    """Comma-separated integers, or None (printed as a usage error) when malformed."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        print(f"error: --sizes must be comma-separated integers, got {text!r}", flush=True)
        return None


def _print_load(report: dict[str, Any], what: str) -> None:
    load = ", ".join(f"{value:.2f}" for value in report["load_average_before"])
    load_after = ", ".join(f"{value:.2f}" for value in report["load_average_after"])
    print(
        f"{what}, {report['repeats']} interleaved repeats per size; load average {load} before, "
        f"{load_after} after ({report['cpu_count']} cores)"
    )


def handle_mooncake_entries(args: argparse.Namespace) -> int:
    """``--axis mooncake-entries``: a master and a storage node per size (``hybridkv_dev.bench.scale_mooncake``)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale_mooncake import (
        MIN_ENTRIES,
        format_mooncake_table,
        namespace_problem,
        plot_mooncake_report,
        run_mooncake_entries_axis,
    )

    sizes = _parse_sizes(args.sizes or "10000,100000,1000000")
    if not sizes or min(sizes) < MIN_ENTRIES or args.repeats < 1:
        print(f"error: --sizes must be >= {MIN_ENTRIES} keys each and --repeats >= 1", flush=True)
        return ExitCode.USAGE
    problem = namespace_problem()
    if problem is not None:
        print(f"error: {problem}", flush=True)
        return ExitCode.USAGE
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hybridkv-scale-mooncake-"))
    report = run_mooncake_entries_axis(
        root, sizes, repeats=args.repeats, progress=lambda line: print(line, flush=True)
    )
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)  # the folder this command made (the processes' logs)
    _print_load(report, f"mooncake, {report['value_bytes']} B values ({report['frame_bytes']} B objects)")
    print(format_mooncake_table(report))
    if report["targets"]:
        print(format_targets(report["targets"]))
    save_report(report, args.out, plot_mooncake_report, no_plot=args.no_plot)
    return ExitCode.OK


def handle_prompt_length(args: argparse.Namespace) -> int:
    """``--axis prompt-length``: the worker's load job per prompt length (``hybridkv_dev.bench.scale_prompt``)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale_prompt import (
        BLOCK_TOKENS,
        format_prompt_table,
        plot_prompt_report,
        run_prompt_length_axis,
    )

    sizes = _parse_sizes(args.sizes or "1024,4096,16384,65536")
    if not sizes or any(size <= 0 or size % BLOCK_TOKENS for size in sizes) or args.repeats < 1:
        print(f"error: --sizes must be multiples of {BLOCK_TOKENS} tokens and --repeats >= 1", flush=True)
        return ExitCode.USAGE
    report = run_prompt_length_axis(
        args.dir, sizes, repeats=args.repeats, progress=lambda line: print(line, flush=True)
    )
    model = report["model"]
    _print_load(
        report,
        f"file store, worker-level load job, {model['family']} {model['size']} {model['dtype']} "
        f"({model['bytes_per_token']} B of KV per token)",
    )
    print(format_prompt_table(report))
    if report["targets"]:
        print(format_targets(report["targets"]))
    save_report(report, args.out, plot_prompt_report, no_plot=args.no_plot)
    return ExitCode.OK


#: The axes with handlers of their own (``entries`` is ``handle_scale``'s).
_AXIS_HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "mooncake-entries": handle_mooncake_entries,
    "prompt-length": handle_prompt_length,
}


def handle_shared(args: argparse.Namespace) -> int:
    """``--axis shared``: 1 -> 4 engine processes on one file store (``hybridkv_dev.bench.scale_shared``)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale_concurrent import default_root
    from hybridkv_dev.bench.scale_shared import format_shared_table, plot_shared_report, run_shared_axis

    engines = _counts_or_usage(args, "1,2,3,4", "engine")
    if engines is None:
        return ExitCode.USAGE
    root = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="hybridkv-scale-shared-", dir=default_root()))
    )
    value_bytes = (args.value_kib or 256) << 10
    report = run_shared_axis(
        root,
        engines,
        repeats=args.repeats,
        rounds=args.rounds or 40,
        batch=args.blocks or 8,
        value_bytes=value_bytes,
        progress=lambda line: print(line, flush=True),
    )
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)  # the folder this command made
    _print_load(report, f"file store shared by engine processes, {value_bytes >> 10} KiB blocks")
    print(format_shared_table(report))
    print(format_targets(report["targets"]))
    save_report(report, args.out, plot_shared_report, no_plot=args.no_plot)
    return ExitCode.OK


def handle_concurrent(args: argparse.Namespace) -> int:
    """``--axis concurrent``: 1 -> 32 hits loading at once from one file store
    (``hybridkv_dev.bench.scale_concurrent``)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale_concurrent import (
        default_root,
        format_concurrent_table,
        plot_concurrent_report,
        run_concurrent_axis,
    )

    counts = _counts_or_usage(args, "1,2,4,8,16,32", "request")
    if counts is None:
        return ExitCode.USAGE
    report = run_concurrent_axis(
        Path(args.dir) if args.dir else default_root(),
        counts,
        repeats=args.repeats,
        blocks=args.blocks or 64,
        value_bytes=(args.value_kib or 1024) << 10,
        progress=lambda line: print(line, flush=True),
    )
    _print_load(report, f"file store, hits of {report['hit_bytes'] / (1 << 20):.1f} MiB loaded at once")
    print(format_concurrent_table(report))
    print(format_targets(report["targets"]))
    save_report(report, args.out, plot_concurrent_report, no_plot=args.no_plot)
    return ExitCode.OK


def handle_mooncake_shared(args: argparse.Namespace) -> int:
    """``--axis mooncake-shared``: 1 -> 4 engine processes on one Mooncake cluster
    (``hybridkv_dev.bench.scale_shared_mooncake``)."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.scale_mooncake import namespace_problem
    from hybridkv_dev.bench.scale_shared_mooncake import (
        format_mooncake_shared_table,
        plot_mooncake_shared_report,
        run_mooncake_shared_axis,
    )

    engines = _counts_or_usage(args, "1,2,3,4", "engine")
    if engines is None:
        return ExitCode.USAGE
    problem = namespace_problem()
    if problem is not None:
        print(f"error: {problem}", flush=True)
        return ExitCode.USAGE
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hybridkv-scale-mooncake-shared-"))
    value_bytes = (args.value_kib or 256) << 10
    report = run_mooncake_shared_axis(
        root,
        engines,
        repeats=args.repeats,
        rounds=args.rounds or 40,
        batch=args.blocks or 8,
        value_bytes=value_bytes,
        progress=lambda line: print(line, flush=True),
    )
    if not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)  # the folder this command made (the processes' logs)
    _print_load(report, f"one Mooncake cluster shared by engine processes, {value_bytes >> 10} KiB blocks")
    print(format_mooncake_shared_table(report))
    print(format_targets(report["targets"]))
    save_report(report, args.out, plot_mooncake_shared_report, no_plot=args.no_plot)
    return ExitCode.OK


_AXIS_HANDLERS["shared"] = handle_shared
_AXIS_HANDLERS["mooncake-shared"] = handle_mooncake_shared
_AXIS_HANDLERS["concurrent"] = handle_concurrent
