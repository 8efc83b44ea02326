"""``hybridkv bench serve``: the OpenAI server under a multi-turn load, per KV-tier configuration."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.cli.bench_options import (
    add_family_argument,
    add_models_dir_argument,
    add_report_arguments,
    add_workdir_argument,
)
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

_DEFAULT_CONFIGS = "none,hybridkv-file,hybridkv-mooncake,mooncake-store"


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve`` to ``bench_subparsers`` (no top-level commands)."""
    del subparsers
    from hybridkv.demo.tiny_models import FAMILIES, SIZES, SIZES_HELP

    from hybridkv_dev.bench.serve import CONFIGS, ServerShape, Workload

    defaults = Workload()
    shape = ServerShape()
    serve = bench_subparsers.add_parser(
        "serve",
        help="the OpenAI server under multi-turn load: no connector vs hybridkv vs MooncakeStoreConnector",
        description="Starts `python -m vllm.entrypoints.openai.api_server` per configuration with a local KV "
        "cache smaller than the working set and drives S sessions x T turns over HTTP at concurrency C "
        "(streamed /v1/chat/completions, greedy), then the eviction probe (a prompt, unique long prompts, "
        "the prompt again). Reports TTFT, latency, throughput, local/external hit tokens, errors, token "
        "agreement with the no-connector run (with how near a tie each differing token was), the serial "
        "pass's exact check, and the after-load checks (nothing pinned, audit clean). "
        "Mooncake configurations need a private network namespace (scripts/netns-run).",
    )
    serve.add_argument(
        "--configs",
        default=_DEFAULT_CONFIGS,
        help=f"comma-separated, of {', '.join(CONFIGS)}, run in this order (default: %(default)s)",
    )
    add_family_argument(serve, FAMILIES)
    serve.add_argument(
        "--size",
        default="tiny",
        choices=SIZES,
        help=f"model size: {SIZES_HELP} (raise --max-model-len for long) (%(default)s)",
    )
    serve.add_argument("--sessions", type=int, default=defaults.num_sessions, help="S (%(default)s)")
    serve.add_argument("--turns", type=int, default=defaults.num_turns, help="T (%(default)s)")
    serve.add_argument("--concurrency", type=int, default=defaults.concurrency, help="C (%(default)s)")
    serve.add_argument(
        "--system-prompts",
        type=int,
        default=defaults.num_system_prompts,
        help="system prompts shared across sessions (%(default)s)",
    )
    serve.add_argument("--system-words", type=int, default=defaults.system_prompt_words, help="(%(default)s)")
    serve.add_argument("--user-words", type=int, default=defaults.user_turn_words, help="(%(default)s)")
    serve.add_argument(
        "--max-tokens", type=int, default=defaults.max_tokens, help="answer length (%(default)s)"
    )
    serve.add_argument(
        "--evict-prompts",
        type=int,
        default=defaults.num_evict_prompts,
        help="unique long prompts of the eviction probe (%(default)s)",
    )
    serve.add_argument(
        "--kv-cache-mib",
        type=int,
        default=shape.kv_cache_bytes >> 20,
        help="the server's local KV cache, MiB: keep it under a quarter of the working set (%(default)s)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=shape.max_model_len,
        help="the servers' max_model_len: raise it for long prompts (%(default)s)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=shape.max_num_batched_tokens,
        help="tokens per engine step (longer prompts prefill in chunks of this) (%(default)s)",
    )
    serve.add_argument(
        "--reserved-cpus",
        type=int,
        default=shape.reserved_cpus,
        help="CPU cores vLLM's CPU backend leaves to other processes, the same for every configuration "
        "(VLLM_CPU_NUM_OF_RESERVED_CPU; vLLM's own default reserves one more with a KV connector) (%(default)s)",
    )
    serve.add_argument(
        "--full-store-capacity",
        default=shape.full_store_capacity,
        help="store capacity of hybridkv-full (%(default)s)",
    )
    serve.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the no-connector server's second pass (its agreement with itself under the same load)",
    )
    serve.add_argument(
        "--serial-sessions",
        type=int,
        default=4,
        help="sessions of the concurrency-1 pass each configuration's server runs before the load, compared "
        "with a no-connector server whose local cache holds it all: hybridkv's greedy tokens must be equal; "
        "0 skips it (%(default)s)",
    )
    serve.add_argument(
        "--trace",
        action="store_true",
        help="hybridkv servers log one event per scheduler step (step_trace); the report's 'trace' follows each "
        "resent-turn hit through the steps (ms from its send to each event, step boundaries waited) and gives "
        "every configuration's vLLM queue and prefill time on those turns",
    )
    add_models_dir_argument(serve)
    add_workdir_argument(serve, "server logs, stores, audit logs")
    serve.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat the whole bench N times, the --configs order rotated by one each run; each run's report "
        "goes to OUT with -run<i> before its suffix, and OUT gets the medians [min, max] over the runs, the "
        "ratios taken per run, and the targets judged at their medians (%(default)s)",
    )
    serve.add_argument(
        "--summarize",
        nargs="+",
        metavar="REPORT",
        default=None,
        help="run nothing: summarize these reports of earlier runs (their --out JSON) as --runs does",
    )
    add_report_arguments(serve, "bench-results/serve.json")
    serve.set_defaults(func=handle_serve)


def _progress_bar(total: int) -> tuple[Callable[[int], None], Callable[[str], None], Callable[[], None]]:
    """(advance, describe, close) of a progress bar on stderr: tqdm when installed, else a counter line."""
    try:
        from tqdm import tqdm
    except ImportError:
        done = [0]
        label = [""]

        def advance(n: int) -> None:
            done[0] += n
            print(f"\r{label[0]} {done[0]}/{total} requests", end="", file=sys.stderr, flush=True)

        def describe(text: str) -> None:
            label[0] = text

        return advance, describe, lambda: print(file=sys.stderr)
    bar: Any = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
    return bar.update, bar.set_description, bar.close


def _summarize(paths: list[str], out: str) -> int:
    """``--summarize``: the summary of earlier runs' reports, printed and written to ``out``."""
    import json

    try:
        reports = [json.loads(Path(path).read_text()) for path in paths]
    except (OSError, ValueError) as error:
        print(f"hybridkv bench serve: --summarize: {error}", file=sys.stderr)
        return EXIT_USAGE
    _print_summary(reports, out, {"reports": list(paths)})
    return EXIT_OK


def _print_summary(reports: list[dict[str, Any]], out: str | Path, extra: dict[str, Any]) -> None:
    """The medians over ``reports`` (``summarize_runs``): printed, and written to ``out`` with ``extra``."""
    from hybridkv.bench.report import write_json

    from hybridkv_dev.bench.serve import format_runs_table, summarize_runs

    summary = summarize_runs(reports)
    print(format_runs_table(summary))
    print(f"wrote {write_json(out, {**summary, **extra})}")


def handle_serve(args: argparse.Namespace) -> int:
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

    from hybridkv_dev.bench.serve import CONFIGS, ServerShape, Workload

    if args.summarize:
        return _summarize(args.summarize, args.out)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if not configs or unknown:
        print(
            f"hybridkv bench serve: unknown --configs {unknown}; expected some of {list(CONFIGS)}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        workload = Workload(
            num_sessions=args.sessions,
            num_turns=args.turns,
            concurrency=args.concurrency,
            num_system_prompts=args.system_prompts,
            system_prompt_words=args.system_words,
            user_turn_words=args.user_words,
            max_tokens=args.max_tokens,
            num_evict_prompts=args.evict_prompts,
        )
    except ValueError as error:
        print(f"hybridkv bench serve: {error}", file=sys.stderr)
        return EXIT_USAGE
    for flag, value in (("--reserved-cpus", args.reserved_cpus), ("--serial-sessions", args.serial_sessions)):
        if value < 0:
            print(f"hybridkv bench serve: {flag} must be >= 0, got {value}", file=sys.stderr)
            return EXIT_USAGE
    for flag, value in (
        ("--max-model-len", args.max_model_len),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--runs", args.runs),
    ):
        if value < 1:
            print(f"hybridkv bench serve: {flag} must be >= 1, got {value}", file=sys.stderr)
            return EXIT_USAGE
    shape = ServerShape(
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        full_store_capacity=args.full_store_capacity,
        reserved_cpus=args.reserved_cpus,
        step_trace=args.trace,
    )
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    model = build_tiny_model(args.family, models_dir, size=args.size)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hybridkv-bench-serve-"))
    if args.runs == 1:
        return _one_run(args, configs, workload, shape, model=model, workdir=workdir, out=Path(args.out))[0]
    from hybridkv_dev.bench.serve import rotated

    out = Path(args.out)
    reports: list[dict[str, Any]] = []
    worst: int = EXIT_OK
    for run in range(args.runs):
        print(f"\nrun {run + 1} of {args.runs}", file=sys.stderr)
        rc, report = _one_run(
            args,
            rotated(configs, run),
            workload,
            shape,
            model=model,
            workdir=workdir / f"run-{run + 1}",
            out=out.with_name(f"{out.stem}-run{run + 1}{out.suffix}"),
        )
        if report is None:
            return rc
        worst = max(worst, rc)
        reports.append(report)
    print()
    _print_summary(reports, out, {})
    return worst


def _one_run(
    args: argparse.Namespace,
    configs: list[str],
    workload: Any,
    shape: Any,
    *,
    model: Path,
    workdir: Path,
    out: Path,
) -> tuple[int, dict[str, Any] | None]:
    """One run of every configuration, in ``configs``' order: prints its tables, writes its report to
    ``out``; returns the exit status and the report (``None`` when the bench could not run)."""
    from hybridkv.bench.report import save_report, write_json

    from hybridkv_dev.bench.serve import EXACT_CONFIGS, format_serve_table, plot_serve, run_serve_bench

    workdir.mkdir(parents=True, exist_ok=True)
    per_pass = workload.num_sessions * workload.num_turns + workload.num_evict_prompts + 2
    per_serial = min(args.serial_sessions, workload.num_sessions) * workload.num_turns
    total = per_pass * (len(configs) + (0 if args.no_self_check or "none" not in configs else 1))
    total += per_serial * (len(configs) + 1)  # + the serial pass's reference server
    advance, describe, close = _progress_bar(total)
    try:
        report = run_serve_bench(
            configs,
            model,
            workload,
            shape,
            workdir,
            self_check=not args.no_self_check,
            serial_sessions=args.serial_sessions,
            progress=advance,
            on_config=describe,
            checkpoint=lambda partial: write_json(out, {**partial, "partial": True}),
        )
    except RuntimeError as error:
        close()
        print(f"hybridkv bench serve: {error}", file=sys.stderr)
        return EXIT_USAGE, None
    close()
    report["workdir"] = str(workdir)
    print(format_serve_table(report))
    if report.get("trace"):
        from hybridkv_dev.bench.serve.trace import format_traces

        print(format_traces(report["trace"]))
    save_report(report, out, plot_serve, no_plot=args.no_plot)
    failed = [
        row["config"]
        for row in report["rows"]
        if row.get("error")
        or row.get("errors")
        or row.get("audit_ok") is False
        or row.get("reset_attempts") is None
        # One request at a time, an external hit must restore exactly what a local hit keeps (the chaos and
        # full-store configurations recompute some prefixes instead, which may round differently).
        or (row["config"] in EXACT_CONFIGS and row.get("serial_agreement", 1.0) != 1.0)
    ]
    if failed:
        print(f"problems under load: {', '.join(failed)} (see {workdir})", file=sys.stderr)
        return EXIT_PROBLEM, report
    return EXIT_OK, report
