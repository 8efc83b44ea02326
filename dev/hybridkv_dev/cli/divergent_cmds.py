"""``hybridkv bench divergent``: a branched conversation on real engines with ``divergent_local_hits`` off and
on -- local and external hit tokens, tokens computed, bytes loaded, time to first token (argument parsing
and printing over :mod:`hybridkv_dev.bench.divergent`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hybridkv.cli.bench_options import add_report_arguments, add_rounds_argument, add_scratch_dir_argument
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_table


def register_bench(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``divergent`` to ``bench_subparsers``."""
    bench = bench_subparsers.add_parser(
        "divergent",
        help="a branched conversation on real engines, divergent_local_hits off vs on: what the store loads",
        description="X = P + Q is served and stored, the local cache drops it and serves P + R (a branch), then "
        "X returns: with divergent_local_hits off vLLM reports no local hit on a recurrent model and the store "
        "serves X's whole prefix; on, vLLM keeps P's pages and the store serves the rest. Tiny random-weight "
        "model, one in-process engine per configuration and round, rounds alternating the order.",
    )
    bench.add_argument(
        "--family",
        default="qwen3_next",
        help="tiny model family with full attention and a recurrent group (%(default)s; also lfm2)",
    )
    add_rounds_argument(bench, default=3, help="rounds, alternating the order")
    bench.add_argument(
        "--scenarios", type=int, default=4, help="branched conversations per engine (%(default)s)"
    )
    add_scratch_dir_argument(bench, "directory for the file stores (default: a temp dir)")
    add_report_arguments(bench, "bench-results/divergent.json", plot=False)
    bench.set_defaults(func=handle_divergent)


def handle_divergent(args: argparse.Namespace) -> int:
    """Run the bench, print its table and targets, write the JSON; 1 when a configuration's tokens differ."""
    from hybridkv.bench.report import format_targets, write_json

    from hybridkv_dev.bench.divergent import DIVERGENT_COLUMNS, run_divergent_bench

    if args.rounds < 1 or args.scenarios < 1:
        print("error: need --rounds >= 1 and --scenarios >= 1", file=sys.stderr)
        return EXIT_USAGE
    report = run_divergent_bench(
        family=args.family,
        num_rounds=args.rounds,
        num_scenarios=args.scenarios,
        scratch_dir=args.scratch_dir,
        progress=lambda line: print(line, file=sys.stderr),
    )
    print(format_table(report["rows"], DIVERGENT_COLUMNS))
    print("\n" + format_targets(report["targets"]))
    print(f"wrote {write_json(args.out, report)}")
    identical = report["targets"][0]
    if not identical["met"]:
        print("problem: a returning conversation's tokens differ from its cold run", file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK
