"""``hybridkv bench soak``: the OpenAI server on a chaos store for a fixed number of requests, sampled for leaks
(argument parsing and printing over :mod:`hybridkv_dev.bench.soak`)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridkv.cli.bench_options import (
    add_family_argument,
    add_models_dir_argument,
    add_report_arguments,
    add_workdir_argument,
)
from hybridkv.cli.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

#: ``--family`` choices (``hybridkv.demo.tiny_models.FAMILIES``, repeated so that building the parser loads
#: no tooling).
_FAMILIES = ("llama", "gemma3", "qwen3_next", "lfm2")
#: ``--dtype`` choices (``hybridkv_dev.bench.soak.plan.SOAK_DTYPES``, repeated for the same reason).
_DTYPES = ("bfloat16", "float32")


def register_bench(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``soak`` to ``bench_subparsers``."""
    soak = bench_subparsers.add_parser(
        "soak",
        help="the OpenAI server on a chaos store for N requests, sampled: nothing may leak",
        description="Starts `python -m vllm.entrypoints.openai.api_server` with hybridkv on a faulty+file:// store "
        "(failed, corrupted and late gets and puts) smaller than the working set, and a local KV cache smaller "
        "than it too; sends N multi-turn chat requests (some aborted mid-stream, some followed by "
        "/reset_prefix_cache) and every K requests samples, with the engine settled: the server's RSS, threads "
        "and open fds (every process), the connector's gauges (tracked requests, pinned blocks, save bytes in "
        "flight, staging bytes out, late calls pending, audit records queued) and the store's files. Passes when "
        "every series stays within its bounds after warm-up, no request failed or was stranded, the audit log is "
        "clean and a serial pass before and after the load gives identical tokens. Exit 1 otherwise.",
    )
    soak.add_argument("--requests", type=int, default=1000, help="requests of the load, N (%(default)s)")
    soak.add_argument("--sample-every", type=int, default=25, help="K: a sample per K requests (%(default)s)")
    add_family_argument(soak, _FAMILIES)
    soak.add_argument("--sessions", type=int, default=4, help="conversations open at once (%(default)s)")
    soak.add_argument("--turns", type=int, default=3, help="turns per conversation (%(default)s)")
    soak.add_argument("--concurrency", type=int, default=2, help="client threads (%(default)s)")
    soak.add_argument(
        "--abort-every",
        type=int,
        default=9,
        help="abort every K-th request mid-stream; 0: none (%(default)s)",
    )
    soak.add_argument(
        "--reset-every",
        type=int,
        default=40,
        help="POST /reset_prefix_cache after every K-th request, every other one with the connector's; "
        "0: none (%(default)s)",
    )
    soak.add_argument(
        "--serial-sessions",
        type=int,
        default=2,
        help="sessions of the serial exactness pass before and after the load; 0: skip it (%(default)s)",
    )
    soak.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the same load on a server without the connector first (vLLM's own memory drift, which the "
        "memory bound is relative to; without it the bound is a fixed one)",
    )
    soak.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.25,
        help="share of the samples before the warm-up cut (%(default)s)",
    )
    soak.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="the server's local KV cache, MiB (6 in bfloat16, 12 in float32: the same tokens)",
    )
    soak.add_argument(
        "--store-capacity-mib",
        type=int,
        default=None,
        help="the file store's capacity, MiB (6 in bfloat16, 12 in float32: the same tokens)",
    )
    soak.add_argument(
        "--chaos",
        default=None,
        help="the faulty+ parameters (default: failed, corrupted and late gets and puts; see "
        "hybridkv_dev.bench.soak.DEFAULT_CHAOS)",
    )
    soak.add_argument(
        "--request-timeout-s",
        type=float,
        default=120.0,
        help="a request unanswered this long fails the run (a stranded request must not hang it) (%(default)s)",
    )
    soak.add_argument(
        "--dtype",
        choices=_DTYPES,
        default="bfloat16",
        help="the engines' dtype; float32 on a CPU without AVX-512, where bfloat16 crawls (%(default)s)",
    )
    add_models_dir_argument(soak)
    add_workdir_argument(soak, "server log, store, audit log")
    add_report_arguments(soak, "bench-results/soak.json")
    soak.set_defaults(func=handle_soak)


def _mib_or_default(mib: int | None, bfloat16_default_bytes: int, dtype: str) -> int:
    """``mib`` in bytes as given, else the plan's bfloat16 default scaled to ``dtype`` (the same tokens)."""
    from hybridkv_dev.bench.soak.plan import sized_for_dtype

    return mib << 20 if mib is not None else sized_for_dtype(bfloat16_default_bytes, dtype)


def handle_soak(args: argparse.Namespace) -> int:
    """Run the soak, print its table, write the JSON and the PNG; exit 1 when it did not pass."""
    from hybridkv.bench.report import save_report
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

    from hybridkv_dev.bench.soak import (
        DEFAULT_CHAOS,
        SOAK_WORKLOAD,
        SoakPlan,
        format_soak_table,
        plot_soak,
        run_soak,
    )

    try:
        plan = SoakPlan(
            num_requests=args.requests,
            sample_every=args.sample_every,
            workload=dataclasses.replace(
                SOAK_WORKLOAD, num_sessions=args.sessions, num_turns=args.turns, concurrency=args.concurrency
            ),
            abort_every=args.abort_every,
            reset_every=args.reset_every,
            serial_sessions=args.serial_sessions,
            warmup_fraction=args.warmup_fraction,
            kv_cache_bytes=_mib_or_default(args.kv_cache_mib, SoakPlan.kv_cache_bytes, args.dtype),
            store_capacity_bytes=_mib_or_default(
                args.store_capacity_mib, SoakPlan.store_capacity_bytes, args.dtype
            ),
            chaos=args.chaos if args.chaos is not None else DEFAULT_CHAOS,
            request_timeout_s=args.request_timeout_s,
            dtype=args.dtype,
        )
    except ValueError as error:
        print(f"hybridkv bench soak: {error}", file=sys.stderr)
        return EXIT_USAGE
    if plan.kv_cache_bytes < 1 << 20 or plan.store_capacity_bytes < 1 << 20:
        print("hybridkv bench soak: --kv-cache-mib and --store-capacity-mib must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    # SIGTERM (a CI job's timeout, `kill`) unwinds like Ctrl-C, so the servers are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(EXIT_INTERRUPTED))
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    model = build_tiny_model(args.family, models_dir)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hybridkv-bench-soak-"))
    done = [0]

    def progress(num: int) -> None:
        done[0] += num
        if done[0] % (plan.sample_every * 5) == 0:
            print(f"  {done[0]} requests", file=sys.stderr, flush=True)

    def phase(name: str) -> None:
        done[0] = 0
        print(f"soak: {name}", file=sys.stderr, flush=True)

    try:
        report = run_soak(
            plan,
            model,
            workdir,
            baseline=not args.no_baseline,
            progress=progress,
            on_phase=phase,
        )
    except RuntimeError as error:  # the server did not start
        print(f"hybridkv bench soak: {error}", file=sys.stderr)
        return EXIT_PROBLEM
    report["workdir"] = str(workdir)
    print(format_soak_table(report))
    save_report(report, args.out, plot_soak, no_plot=args.no_plot)
    if not report["passed"]:
        print(f"soak failed (server log, store, audit log: {workdir})", file=sys.stderr)
        return EXIT_PROBLEM
    return EXIT_OK
