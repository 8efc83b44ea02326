"""``hybridkv bench ttft`` (time to first token through a real vLLM engine) and ``hybridkv bench lookup``
(the connector's scheduler-side lookup vs the bare store call)."""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path
from typing import Any

from hybridkv.cli._output import format_table, pyplot_or_none, save_report
from hybridkv.connector.tiny_models import FAMILIES

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

_TTFT_COLUMNS = [
    "family",
    "connector",
    "cold_ms",
    "local_hit_ms",
    "external_hit_ms",
    "external_hit_tokens",
    "loaded_mb",
    "load_job_ms",
    "load_job_idle_ms",
    "copy_floor_ms",
    "external_over_local",
    "cold_over_external",
    "overhead_over_floor",
]

_SCHEDULER_COLUMNS = [
    "store",
    "num_steps",
    "schedule_p50_ms",
    "schedule_p99_ms",
    "p99_ratio",
    "lookups_per_s",
    "round_trips_p50",
    "round_trips_max",
    "keys_p50",
    "keys_max",
    "hit_tokens",
    "full_scan_hit_tokens",
    "lookup_errors",
]

_LOOKUP_COLUMNS = [
    "geometry",
    "store",
    "prompt_tokens",
    "num_keys",
    "bare_p50_us",
    "bare_p99_us",
    "lifecycle_p50_us",
    "lifecycle_p99_us",
    "connector_p50_us",
    "connector_p99_us",
    "connector_over_bare_p50",
    "connector_over_bare_p99",
]


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``ttft`` and ``lookup`` to ``bench_subparsers`` (no top-level commands)."""
    del subparsers
    ttft = bench_subparsers.add_parser(
        "ttft",
        help="time to first token: cold vs local prefix-cache hit vs external (store) hit, one vLLM engine",
        description="Starts one in-process vLLM engine per family with HybridStoreConnector on a file:// store "
        "(under /dev/shm when present) and times llm.generate(max_tokens=1) of one request: cold prefill, "
        "local prefix-cache hit, and external hit after reset_prefix_cache(). Medians over rounds, ratios "
        "measured in the same run, the bytes loaded and their memcpy floor; vLLM's ExampleConnector as an "
        "in-tree baseline for non-hybrid families.",
    )
    ttft.add_argument(
        "--family",
        default="llama,lfm2",
        help=f"comma-separated model families, of {', '.join(FAMILIES)} (default: %(default)s)",
    )
    ttft.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (%(default)s)")
    ttft.add_argument("--rounds", type=int, default=3, help="rounds, each on a fresh prompt (%(default)s)")
    ttft.add_argument(
        "--size",
        default="bench",
        choices=["bench", "tiny"],
        help="model size: bench = hidden 1024, 8 layers, 4 KV heads x 128; tiny = the test models (%(default)s)",
    )
    ttft.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="engine dtype; auto = bfloat16 on CPUs with AVX512-BF16/AMX, else float32 (%(default)s)",
    )
    ttft.add_argument(
        "--no-baseline", action="store_true", help="skip vLLM's ExampleConnector baseline engine"
    )
    ttft.add_argument(
        "--models-dir",
        default=None,
        help="where models are built (default: $HYBRIDKV_TEST_MODELS or /tmp/hybridkv-test-models)",
    )
    ttft.add_argument("--out", default="bench-results/ttft.json", help="JSON report path (%(default)s)")
    ttft.add_argument("--no-plot", action="store_true", help="skip the PNG even if matplotlib is installed")
    ttft.set_defaults(func=handle_ttft)

    lookup = bench_subparsers.add_parser(
        "lookup",
        help="scheduler-side lookup cost vs the bare store.exists call (p50/p99 us)",
        description="For the ttft models' geometries and several prompt lengths: the bare store.exists of the "
        "candidate keys, the lifecycle's key generation + boundary resolution alone, and the connector's "
        "whole SchedulerSide.lookup, on memory:// and file:// stores (plus any --store URL).",
    )
    lookup.add_argument(
        "--store",
        dest="stores",
        action="append",
        metavar="URL",
        help="extra store URL to measure, e.g. mooncake://... (repeatable; memory:// and file:// always run)",
    )
    lookup.add_argument("--geometry", default="llama,lfm2", help="comma-separated: llama, lfm2 (%(default)s)")
    lookup.add_argument(
        "--prompt-tokens", default="1024,4096,16384", help="comma-separated prompt lengths (%(default)s)"
    )
    lookup.add_argument("--iterations", type=int, default=300, help="timed calls per measure (%(default)s)")
    lookup.add_argument("--models-dir", default=None, help="where the tiny model for vLLM's config is built")
    lookup.add_argument("--out", default="bench-results/lookup.json", help="JSON report path (%(default)s)")
    lookup.add_argument("--no-plot", action="store_true", help="skip the PNG even if matplotlib is installed")
    lookup.set_defaults(func=handle_lookup)

    scheduler = bench_subparsers.add_parser(
        "scheduler",
        help="vLLM's real Scheduler with and without the connector at K3-like geometry (schedule() p50/p99)",
        description="MLA block 64 x DCP 8 + Mamba, hash unit 64; a stream of long prompts (hits and misses) "
        "added a few per step; schedule() p50/p99 without the connector and per store URL, lookups per "
        "second, store round trips and keys per lookup, hit tokens vs the synchronous full scan.",
    )
    scheduler.add_argument(
        "--store",
        dest="stores",
        action="append",
        metavar="URL",
        help="store URL to measure (repeatable; default: faulty+memory://...?delay_ms=5)",
    )
    scheduler.add_argument("--requests", type=int, default=12, help="requests in the stream (%(default)s)")
    scheduler.add_argument("--max-tokens", type=int, default=131072, help="longest prompt (%(default)s)")
    scheduler.add_argument("--per-step", type=int, default=2, help="requests added per step (%(default)s)")
    scheduler.add_argument(
        "--models-dir", default=None, help="where the tiny model for vLLM's config is built"
    )
    scheduler.add_argument(
        "--out", default="bench-results/scheduler.json", help="JSON report path (%(default)s)"
    )
    scheduler.set_defaults(func=handle_scheduler)


def handle_ttft(args: argparse.Namespace) -> int:
    from hybridkv.connector.bench_ttft import DEFAULT_MODELS_DIR, default_scratch_dir, run_ttft_bench

    families = _csv(args.family)
    unknown = sorted(set(families) - set(FAMILIES))
    if not families or unknown or args.rounds < 1 or args.prompt_tokens < 1:
        print(
            f"error: need --family from {list(FAMILIES)} (unknown: {unknown}), --rounds >= 1, --prompt-tokens >= 1",
            file=sys.stderr,
        )
        return EXIT_USAGE
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    with default_scratch_dir() as scratch:
        report = run_ttft_bench(
            families,
            scratch_dir=scratch,
            prompt_tokens=args.prompt_tokens,
            rounds=args.rounds,
            size=args.size,
            dtype=args.dtype,
            baseline=not args.no_baseline,
            models_dir=models_dir,
        )
    print(
        f"prompt {report['prompt_tokens']} tokens, {report['rounds']} rounds, dtype {report['dtype']}, "
        f"size {report['size']} (medians; ratios from the same run)"
    )
    print(format_table(report["rows"], _TTFT_COLUMNS))
    for line in report["not_measured"]:
        print(f"not measured: {line}")
    save_report(report, args.out, _plot_ttft, no_plot=args.no_plot)
    status = EXIT_OK
    for row in report["rows"]:
        if row["connector"] == "HybridStoreConnector" and not row["loaded_bytes"]:
            print(f"problem: {row['family']}: the external hit loaded no bytes", file=sys.stderr)
            status = EXIT_PROBLEM
    return status


def handle_lookup(args: argparse.Namespace) -> int:
    from hybridkv.connector.bench_lookup import DEFAULT_GEOMETRIES, DEFAULT_MODELS_DIR, run_lookup_bench
    from hybridkv.store.bench import bench_scratch_dir

    try:
        sizes = [int(text) for text in _csv(args.prompt_tokens)]
    except ValueError:
        print(
            f"error: --prompt-tokens must be comma-separated integers, got {args.prompt_tokens!r}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    geometries = _csv(args.geometry)
    if (
        not sizes
        or min(sizes) < 1
        or args.iterations < 2
        or not geometries
        or set(geometries) - set(DEFAULT_GEOMETRIES)
    ):
        print(
            "error: need positive --prompt-tokens, --iterations >= 2, --geometry of llama, lfm2",
            file=sys.stderr,
        )
        return EXIT_USAGE
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    with bench_scratch_dir() as scratch:
        urls = [f"memory://bench-lookup-{uuid.uuid4().hex[:8]}", f"file://{scratch}/store?capacity=256MiB"]
        urls += args.stores or []
        try:
            report = run_lookup_bench(
                urls,
                geometries=geometries,
                prompt_tokens=sizes,
                iterations=args.iterations,
                models_dir=models_dir,
            )
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_USAGE
        except AssertionError as error:
            print(f"problem: {error}", file=sys.stderr)
            return EXIT_PROBLEM
    print(format_table(report["rows"], _LOOKUP_COLUMNS))
    save_report(report, args.out, _plot_lookup, no_plot=args.no_plot)
    return EXIT_OK


def handle_scheduler(args: argparse.Namespace) -> int:
    from hybridkv.connector.bench_scheduler import run_scheduler_bench
    from hybridkv.connector.tiny_models import DEFAULT_MODELS_DIR

    if args.requests < 1 or args.max_tokens < 4096 or args.per_step < 1:
        print("error: need --requests >= 1, --max-tokens >= 4096, --per-step >= 1", file=sys.stderr)
        return EXIT_USAGE
    urls = args.stores or [f"faulty+memory://bench-sched-{uuid.uuid4().hex[:8]}?delay_ms=5"]
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    report = run_scheduler_bench(
        urls,
        num_requests=args.requests,
        max_tokens=args.max_tokens,
        per_step=args.per_step,
        models_dir=models_dir,
    )
    print(
        f"{report['geometry']}; {report['num_requests']} requests up to {report['max_prompt_tokens']} tokens"
    )
    print(format_table(report["rows"], _SCHEDULER_COLUMNS))
    save_report(report, args.out, lambda _report, _path: None, no_plot=True)
    status = EXIT_OK
    for row in report["rows"][1:]:
        if row["hit_tokens"] != row["full_scan_hit_tokens"]:
            print(f"problem: {row['store']}: hit tokens differ from the full scan", file=sys.stderr)
            status = EXIT_PROBLEM
    return status


def _plot_ttft(report: dict[str, Any], path: Path) -> Path | None:
    """Bars of cold / local / external TTFT per (family, connector), log scale; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    labels = [f"{row['family']}\n{row['connector'].split(' ')[0]}" for row in rows]
    positions = list(range(len(rows)))
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 1.6), 4))
    for offset, key, label in (
        (-0.27, "cold_ms", "cold"),
        (0.0, "local_hit_ms", "local hit"),
        (0.27, "external_hit_ms", "external hit"),
    ):
        axes.bar([p + offset for p in positions], [row[key] or 0 for row in rows], width=0.27, label=label)
    axes.set_yscale("log")
    axes.set_xticks(positions, labels, fontsize=7)
    axes.set_ylabel(f"TTFT ms ({report['prompt_tokens']} tokens)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_lookup(report: dict[str, Any], path: Path) -> Path | None:
    """p50 of bare exists vs the connector's lookup per prompt length, one line per (geometry, store)."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in report["rows"]:
        series.setdefault((row["geometry"], row["store"].split("://")[0]), []).append(row)
    for (geometry, scheme), rows in series.items():
        xs = [row["prompt_tokens"] for row in rows]
        axes.plot(
            xs, [row["connector_p50_us"] for row in rows], marker="o", label=f"{geometry} {scheme} connector"
        )
        axes.plot(
            xs,
            [row["bare_p50_us"] for row in rows],
            linestyle="--",
            marker=".",
            label=f"{geometry} {scheme} bare",
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("p50 us")
    axes.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
