"""``hybridkv bench agentic-serve``: the seeded agentic trace replayed through real vLLM servers, per KV-tier
configuration at one store capacity (argument parsing and printing over :mod:`hybridkv_dev.bench.agentic_serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridkv.cli.bench_options import (
    add_models_dir_argument,
    add_report_arguments,
    add_rounds_argument,
    add_scratch_dir_argument,
    add_seed_argument,
    add_workdir_argument,
)
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_table

#: The configurations (``hybridkv_dev.bench.agentic_serve.CONFIGURATIONS``, repeated so that building the parser
#: loads no tooling).
_CONFIGURATIONS = ("file-lru", "file-lru+sessions", "mooncake-store", "none")

#: Flags that override a ``ServeSetup`` field when given (their defaults are the bench's own, shown by
#: ``--help`` as "the bench's").
_SETUP_FLAGS = {
    "sessions": "num_sessions",
    "max_requests": "max_requests",
    "token_scale": "token_scale",
    "capacity_fraction": "capacity_fraction",
    "kv_cache_mib": "kv_cache_mib",
    "block_size": "block_tokens",
    "max_tokens": "max_tokens",
    "concurrency": "concurrency",
    "max_model_len": "max_model_len",
    "session_ttl_s": "session_ttl_s",
    "reserved_cpus": "reserved_cpus",
}


def register_bench(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``agentic-serve`` to ``bench_subparsers``."""
    bench = bench_subparsers.add_parser(
        "agentic-serve",
        help="the agentic trace through real vLLM servers: hybridkv LRU vs +sessions vs MooncakeStoreConnector",
        description="Generates `hybridkv bench agentic`'s seeded agentic trace (scaled to fit the tiny model), "
        "and replays it in trace order (clock compressed) through `python -m vllm.entrypoints.openai.api_server` "
        "as token-id /v1/completions (streamed, greedy, cache_salt = tenant), one fresh server and store per "
        "configuration and round, every store of the same capacity (a fraction of the trace's working set) and "
        "a local KV cache smaller than it. Reports external hit tokens and their share of the prompt tokens, "
        "TTFT p50/p99, store bytes written and failed requests, medians over interleaved rounds, and a plot "
        "of the share served from the store over the trace. mooncake-store needs a private network namespace "
        "(scripts/netns-run).",
    )
    bench.add_argument(
        "--configs",
        default=",".join(_CONFIGURATIONS),
        help=f"comma-separated, of {', '.join(_CONFIGURATIONS)} (default: %(default)s)",
    )
    add_rounds_argument(bench, default=3, help="interleaved rounds, seed + r")
    add_seed_argument(bench)
    bench.add_argument("--sessions", type=int, default=None, help="agent sessions (default: the bench's, 16)")
    bench.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="replay the trace's first N requests (time order; default: the bench's, 600)",
    )
    bench.add_argument(
        "--token-scale",
        type=int,
        default=None,
        help="real tokens per trace token (`bench agentic`'s is 64; default: the bench's, 256)",
    )
    bench.add_argument(
        "--capacity-fraction",
        type=float,
        default=None,
        help="every store's capacity, a fraction of the trace's working set (default: the bench's, 0.25)",
    )
    bench.add_argument(
        "--kv-cache-mib",
        type=float,
        default=None,
        help="the servers' local KV cache, MiB (default: the bench's, 10)",
    )
    bench.add_argument(
        "--block-size", type=int, default=None, help="vLLM's KV block, tokens (default: the bench's, 32)"
    )
    bench.add_argument(
        "--max-tokens", type=int, default=None, help="greedy tokens per request (default: the bench's, 4)"
    )
    bench.add_argument(
        "--concurrency",
        type=int,
        choices=(1, 2),
        default=None,
        help="requests in flight; each waits for those of its session (default: the bench's, 1)",
    )
    bench.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the servers' max_model_len; longer prompts are left out (default: the bench's, 2048)",
    )
    bench.add_argument(
        "--session-ttl-s",
        type=float,
        default=None,
        help="ttl_s of file-lru+sessions' hints (default: the bench's, 3600)",
    )
    bench.add_argument(
        "--reserved-cpus",
        type=int,
        default=None,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server (default: the bench's, 1)",
    )
    add_models_dir_argument(bench, "where the model is built (default: $HYBRIDKV_TEST_MODELS)")
    add_workdir_argument(bench, "server and master logs")
    add_scratch_dir_argument(bench)
    add_report_arguments(bench, "bench-results/agentic-serve.json")
    bench.set_defaults(func=handle_agentic_serve)


def handle_agentic_serve(args: argparse.Namespace) -> int:
    """Run the bench, print the trace's shape, the table and the targets, write the JSON and the PNG."""
    from hybridkv.bench.report import format_targets, save_report

    from hybridkv_dev.bench.agentic_serve import (
        TABLE_COLUMNS,
        ServeSetup,
        bench_model,
        describe_report,
        plot_report,
        run_agentic_serve_bench,
    )

    configurations = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configurations if c not in _CONFIGURATIONS]
    if not configurations or unknown:
        print(
            f"error: unknown --configs {unknown}; expected some of {list(_CONFIGURATIONS)}", file=sys.stderr
        )
        return EXIT_USAGE
    if args.rounds < 1:
        print("error: need --rounds >= 1", file=sys.stderr)
        return EXIT_USAGE
    overrides = {
        field: getattr(args, flag) for flag, field in _SETUP_FLAGS.items() if getattr(args, flag) is not None
    }
    try:
        setup = dataclasses.replace(ServeSetup(), **overrides)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    model = bench_model(Path(args.models_dir) if args.models_dir else None)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hybridkv-agentic-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = run_agentic_serve_bench(
            model,
            setup,
            workdir,
            configurations=configurations,
            num_rounds=args.rounds,
            seed=args.seed,
            scratch_dir=args.scratch_dir,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (RuntimeError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    report["workdir"] = str(workdir)
    print(describe_report(report))
    print(format_table(report["rows"], TABLE_COLUMNS))
    for row in report["rows"]:
        for run in report["runs"][row["configuration"]]:
            if "error" in run:
                lines = run["error"].strip().splitlines()
                print(
                    f"{row['configuration']} round {run['round']}: failed: {lines[-1][-300:] if lines else '?'}"
                )
    print("\n" + format_targets(report["targets"]))
    save_report(report, args.out, plot_report, no_plot=args.no_plot)
    failed = sum(row["errors"] + row["failed_rounds"] for row in report["rows"])
    if failed:
        print(f"problem: {failed} failed requests or runs (see {workdir})", file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK
