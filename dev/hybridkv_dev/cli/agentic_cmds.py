"""``hybridkv bench agentic``: a seeded agentic trace replayed through real stores, the prompt tokens they serve
(argument parsing and printing over :mod:`hybridkv_dev.bench.agentic`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hybridkv.cli.bench_options import (
    add_report_arguments,
    add_rounds_argument,
    add_scratch_dir_argument,
    add_seed_argument,
)
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_table

#: ``--store`` choices (``hybridkv_dev.bench.agentic.STORE_CHOICES``, repeated so that building the parser
#: loads no tooling).
_STORE_CHOICES = ("memory", "file", "both")


def register_bench(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``agentic`` to ``bench_subparsers``."""
    bench = bench_subparsers.add_parser(
        "agentic",
        help="a seeded agentic trace (sessions, sub-agents, pauses, one-offs) through real stores: tokens served",
        description="Generates an agentic trace from a seed (sessions of ~43 turns re-sending a growing prefix, "
        "sub-agent forks, tool and human pauses, several tenants, one-off background requests) and replays it "
        "through real stores at a capacity below its working set, as the connector would (lookup, load of the "
        "hit, save of the rest): the share of prompt tokens each store configuration serves, the bytes it "
        "writes and each tenant's evicted bytes, over interleaved rounds (one seed per round).",
    )
    add_seed_argument(bench)
    add_rounds_argument(bench, default=5, help="interleaved rounds, seed + r in round r")
    bench.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.1,
        help="store capacity as a fraction of the trace's working set (%(default)s)",
    )
    bench.add_argument(
        "--store",
        choices=_STORE_CHOICES,
        default="memory",
        help="memory: lru, lru+quotas, lru+sessions; file: file-lru, file-lru+quotas, file-lru+sessions; both: all six (%(default)s)",
    )
    bench.add_argument(
        "--background-quota-fraction",
        type=float,
        default=0.2,
        help="the background tenant's quota in the +quotas configurations, a fraction of capacity (%(default)s)",
    )
    bench.add_argument(
        "--sessions", type=int, default=None, help="agent sessions (default: the workload's, 24)"
    )
    bench.add_argument(
        "--median-turns",
        type=float,
        default=None,
        help="median turns per session (default: the workload's, 43)",
    )
    add_scratch_dir_argument(bench)
    add_report_arguments(bench, "bench-results/agentic.json")
    bench.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    bench.set_defaults(func=handle_agentic)

    policies = bench_subparsers.add_parser(
        "agentic-policies",
        help="eviction orders from the literature (LRU, leaf-first, S3-FIFO) and two oracles (admission, "
        "clairvoyant MIN) modelled on the agentic trace: prompt tokens served",
        description="Replays the agentic trace of `hybridkv bench agentic` through models of eviction orders "
        "(no store: entries and their sizes only) at several capacities: the share of prompt tokens each "
        "serves, medians over seeds with [min, max], points against LRU per seed, and the 15-point target.",
    )
    add_seed_argument(policies)
    add_rounds_argument(policies, default=5, help="seeds, seed + r in round r")
    policies.add_argument(
        "--capacity-fractions",
        default="0.02,0.05,0.1",
        help="comma-separated store capacities as fractions of the working set (%(default)s)",
    )
    add_report_arguments(policies, "bench-results/agentic-policies.json", plot=False)
    policies.set_defaults(func=handle_agentic_policies)


def handle_agentic_policies(args: argparse.Namespace) -> int:
    """Model every eviction order at every capacity; print the table and the targets, write the JSON."""
    from hybridkv.bench.report import format_targets, write_json

    from hybridkv_dev.bench.agentic import AgenticWorkload
    from hybridkv_dev.bench.agentic_policies import POLICY_COLUMNS, run_policy_model

    try:
        fractions = [float(part) for part in args.capacity_fractions.split(",")]
    except ValueError:
        fractions = []
    if args.rounds < 1 or not fractions or any(not f > 0 for f in fractions):
        print(
            f"error: need --rounds >= 1 and --capacity-fractions of numbers > 0, got {args.capacity_fractions!r}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    report = run_policy_model(
        AgenticWorkload(), seed=args.seed, num_rounds=args.rounds, capacity_fractions=fractions
    )
    print(format_table(report["rows"], POLICY_COLUMNS))
    print("\n" + format_targets(report["targets"]))
    print(f"wrote {write_json(args.out, report)}")
    return EXIT_OK


def handle_agentic(args: argparse.Namespace) -> int:
    """Run the bench, print the trace's shape, the tables and the targets, write the JSON and the PNG."""
    import dataclasses

    from hybridkv.bench.report import format_targets, write_json

    from hybridkv_dev.bench.agentic import (
        TABLE_COLUMNS,
        AgenticWorkload,
        configurations_for,
        describe_shape,
        evicted_by_background_table_rows,
        evicted_table_rows,
        plot_report,
        run_agentic_bench,
    )

    if args.rounds < 1 or args.capacity_fraction <= 0 or not 0 < args.background_quota_fraction <= 1:
        print(
            "error: need --rounds >= 1, --capacity-fraction > 0 and 0 < --background-quota-fraction <= 1",
            file=sys.stderr,
        )
        return EXIT_USAGE
    overrides: dict[str, Any] = {}
    if args.sessions is not None:
        overrides["num_sessions"] = args.sessions
    if args.median_turns is not None:
        overrides["median_turns"] = args.median_turns
    if (args.sessions is not None and args.sessions < 1) or (
        args.median_turns is not None and args.median_turns <= 0
    ):
        print("error: need --sessions >= 1 and --median-turns > 0", file=sys.stderr)
        return EXIT_USAGE
    workload = dataclasses.replace(AgenticWorkload(), **overrides)
    report = run_agentic_bench(
        workload,
        seed=args.seed,
        num_rounds=args.rounds,
        capacity_fraction=args.capacity_fraction,
        background_quota_fraction=args.background_quota_fraction,
        configurations=configurations_for(args.store),
        scratch_dir=args.scratch_dir,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print(describe_shape(report))
    for unavailable in report["unavailable"]:
        print(f"unavailable: {unavailable['configuration']}: {unavailable['error']}")
    print(format_table(report["rows"], TABLE_COLUMNS))
    evicted_rows, evicted_columns = evicted_table_rows(report)
    print("\nevicted MiB by tenant (median over rounds):")
    print(format_table(evicted_rows, evicted_columns))
    by_background_rows, by_background_columns = evicted_by_background_table_rows(report)
    print(
        "\nMiB of the other tenants evicted by background puts, as the store did it (listings around each; "
        "over quota: the background held more than its quota in framed bytes before or after the put):"
    )
    print(format_table(by_background_rows, by_background_columns))
    print("\n" + format_targets(report["targets"]))
    target = write_json(args.out, report)
    print(f"wrote {target}")
    if not args.no_plot:
        png = plot_report(report, Path(args.plot) if args.plot else target.with_suffix(".png"))
        if png is not None:
            print(f"wrote {png}")
    num_load_failures = sum(row["load_failures"] for row in report["rows"])
    if num_load_failures:  # nothing else uses the store during a replay: a hit it found must load
        print(f"problem: {num_load_failures} loads of hits found by the lookup failed", file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK
