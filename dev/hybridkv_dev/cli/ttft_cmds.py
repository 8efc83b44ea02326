"""``hybridkv bench ttft`` (time to first token through a real vLLM engine) and ``hybridkv bench lookup``
(the connector's scheduler-side lookup vs the bare store call)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from hybridkv.cli.bench_options import add_models_dir_argument, add_report_arguments, add_rounds_argument
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_cell, format_table


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


#: ``--models-dir`` of the benches that only read a tiny model's config.
_TINY_CONFIG_MODEL = "where the tiny model for vLLM's config is built"


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``ttft`` and ``lookup`` to ``bench_subparsers`` (no top-level commands)."""
    del subparsers
    from hybridkv.demo.tiny_models import SIZES, SIZES_HELP

    ttft = bench_subparsers.add_parser(
        "ttft",
        help="time to first token: cold vs local prefix-cache hit vs external (store) hit, one vLLM engine",
        description="Starts one in-process vLLM engine per family with HybridStoreConnector on a file:// store "
        "(under /dev/shm when present) and times llm.generate(max_tokens=1) of one request: cold prefill, "
        "local prefix-cache hit, and external hit after reset_prefix_cache(). Medians over rounds, ratios "
        "measured in the same run, the bytes loaded and their memcpy floor; vLLM's ExampleConnector as an "
        "in-tree baseline for non-hybrid families; with --mooncake, hybridkv on Mooncake and vLLM's "
        "MooncakeStoreConnector too. Each hit's overhead above the local hit, over the memcpy floor and over "
        "MooncakeStoreConnector's, and where the hybridkv hit spends its time.",
    )
    ttft.add_argument(
        "--family",
        default="llama,lfm2",
        help="comma-separated model families, of llama, gemma3, qwen3_next, lfm2 (default: %(default)s)",
    )
    ttft.add_argument("--prompt-tokens", type=int, default=4000, help="prompt length (%(default)s)")
    add_rounds_argument(ttft, default=3, help="rounds, each on a fresh prompt")
    ttft.add_argument(
        "--size",
        default="bench",
        choices=SIZES,
        help=f"model size: {SIZES_HELP} (%(default)s)",
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
        "--mooncake",
        action="store_true",
        help="also hybridkv on mooncake:// and vLLM's MooncakeStoreConnector (own process), against a "
        "mooncake_master the bench starts on 127.0.0.1; run inside a loopback-only network namespace: "
        "scripts/netns-run hybridkv bench ttft --mooncake",
    )
    ttft.add_argument(
        "--keyed",
        action="store_true",
        help="also hybridkv on a file:// store in keyed-integrity mode (integrity_key_file, a fresh secret): "
        "the mode's cost next to the plain file:// row",
    )
    ttft.add_argument(
        "--models-dir",
        default=None,
        help="where models are built (default: $HYBRIDKV_TEST_MODELS or /tmp/hybridkv-test-models)",
    )
    ttft.add_argument(
        "--scratch-dir",
        default=None,
        help="directory under which the file:// stores (and the peers' files) live, e.g. a huge-page tmpfs "
        "mount (default: a temp dir under /dev/shm when present)",
    )
    ttft.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="cores every engine leaves to the connectors' threads and other jobs: each computes with "
        "cores - N torch threads (at least 1), the MooncakeStoreConnector child too (%(default)s)",
    )
    add_report_arguments(ttft, "bench-results/ttft.json")
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
    add_models_dir_argument(lookup, _TINY_CONFIG_MODEL)
    add_report_arguments(lookup, "bench-results/lookup.json")
    lookup.set_defaults(func=handle_lookup)

    scheduler = bench_subparsers.add_parser(
        "scheduler",
        help="vLLM's real Scheduler with and without the connector at K3-like geometry (schedule() p50/p99)",
        description="MLA block 64 x DCP 8 + Mamba, hash unit 64; a stream of long prompts (hits and misses) "
        "added a few per step; schedule() p50/p99 without the connector and per store URL (busy and idle "
        "steps, the connector's own calls vs vLLM's part), lookups per second, store round trips and keys per "
        "lookup, hit tokens vs the synchronous full scan. With the peer (default when the Mooncake wheel "
        "imports and the command runs under scripts/netns-run): vLLM's MooncakeStoreConnector, synchronous "
        "and lookup_async lookups (on vLLM 0.34 also lookup_async with lookup prefetch), against a real mooncake_master behind a delay proxy, and hybridkv on the "
        "same deployment.",
    )
    scheduler.add_argument(
        "--store",
        dest="stores",
        action="append",
        metavar="URL",
        help="store URL to measure (repeatable; default: faulty+memory://...?delay_ms=5)",
    )
    scheduler.add_argument(
        "--mooncake-delay-ms",
        type=float,
        action="append",
        default=[],
        metavar="MS",
        help="also measure a real mooncake_master (and storage node) reached through a delay proxy adding "
        "MS one way to every master call (repeatable; needs the private namespace: scripts/netns-run)",
    )
    scheduler.add_argument("--requests", type=int, default=24, help="requests in the stream (%(default)s)")
    add_rounds_argument(scheduler, default=5, help="interleaved rounds; medians and spread over them")
    scheduler.add_argument(
        "--forward-ms",
        type=float,
        default=1.0,
        help="pause between schedule() calls standing in for the forward pass (%(default)s)",
    )
    scheduler.add_argument(
        "--peer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also vLLM's MooncakeStoreConnector (lookup_async false and true; on vLLM 0.34 also true with "
        "lookup_prefetch_limit), its lookups served by its own "
        "worker code in a child process against a real mooncake_master, and hybridkv on the same deployment "
        "(default: on when the Mooncake wheel imports and this runs in a loopback-only namespace: "
        "scripts/netns-run)",
    )
    scheduler.add_argument(
        "--peer-delay-ms",
        type=float,
        default=2.5,
        metavar="MS",
        help="one-way delay of the peer's Mooncake master link, so an exists costs about 2 x MS like the "
        "default store's 5 ms per call (%(default)s)",
    )
    scheduler.add_argument(
        "--lookup-process",
        action="store_true",
        help="also measure every store other processes can open (file://, mooncake://: the Mooncake rows) "
        "with lookup_process true: its lookups in a process of the connector's own",
    )
    scheduler.add_argument(
        "--idle-steps",
        type=int,
        default=64,
        help="schedule() calls after the stream drained, idle steps every configuration has (%(default)s)",
    )
    scheduler.add_argument(
        "--inflight",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the may_load_async axis (vLLM 0.34): a full running batch, --max-num-inflight-kv-loads set, "
        "hit requests arriving; steps from arrival to first scheduled token with the connector's may_load_async "
        "and with vLLM's default answer, --rounds interleaved rounds (default: on with vLLM 0.34)",
    )
    scheduler.add_argument(
        "--inflight-hits",
        type=int,
        default=8,
        help="hit requests per run of the may_load_async axis (%(default)s)",
    )
    scheduler.add_argument(
        "--inflight-load-steps", type=int, default=4, help="engine steps a load takes there (%(default)s)"
    )
    scheduler.add_argument(
        "--inflight-cap", type=int, default=2, help="its --max-num-inflight-kv-loads (%(default)s)"
    )
    scheduler.add_argument("--max-tokens", type=int, default=131072, help="longest prompt (%(default)s)")
    scheduler.add_argument("--per-step", type=int, default=2, help="requests added per step (%(default)s)")
    add_models_dir_argument(scheduler, _TINY_CONFIG_MODEL)
    add_report_arguments(scheduler, "bench-results/scheduler.json", plot=False)
    scheduler.set_defaults(func=handle_scheduler)


def handle_ttft(args: argparse.Namespace) -> int:
    from hybridkv.bench.report import format_targets, save_report
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, FAMILIES

    from hybridkv_dev.bench.ttft import (
        PROFILE_COLUMNS,
        TABLE_COLUMNS,
        default_scratch_dir,
        plot_report,
        run_ttft_bench,
    )
    from hybridkv_dev.devkit.net import loopback_only_namespace

    families = _csv(args.family)
    unknown = sorted(set(families) - set(FAMILIES))
    if not families or unknown or args.rounds < 1 or args.prompt_tokens < 1 or args.reserved_cpus < 0:
        print(
            f"error: need --family from {list(FAMILIES)} (unknown: {unknown}), --rounds >= 1, "
            "--prompt-tokens >= 1, --reserved-cpus >= 0",
            file=sys.stderr,
        )
        return EXIT_USAGE
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    if args.mooncake and not loopback_only_namespace():
        print(
            "error: --mooncake needs a private network namespace with only 'lo' (Mooncake clients listen on "
            "0.0.0.0): run it as `scripts/netns-run hybridkv bench ttft --mooncake ...`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.scratch_dir is not None and not os.path.isdir(args.scratch_dir):
        print(f"error: --scratch-dir {args.scratch_dir!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    with default_scratch_dir(args.scratch_dir) as scratch:
        report = run_ttft_bench(
            families,
            scratch_dir=scratch,
            prompt_tokens=args.prompt_tokens,
            rounds=args.rounds,
            size=args.size,
            dtype=args.dtype,
            baseline=not args.no_baseline,
            mooncake=args.mooncake,
            models_dir=models_dir,
            reserved_cpus=args.reserved_cpus,
            keyed=args.keyed,
        )
    print(
        f"prompt {report['prompt_tokens']} tokens, {report['rounds']} rounds, dtype {report['dtype']}, "
        f"size {report['size']}, {report['compute_threads']} compute threads per engine on "
        f"{report['host']['cpus']} cores, load average {report['loadavg_before'][0]:.1f} -> "
        f"{report['loadavg_after'][0]:.1f} (medians; spread = min..max over rounds; ratios from the same run)"
    )
    print(format_table([_with_spreads(row) for row in report["rows"]], TABLE_COLUMNS))
    print("\nwhere the hybridkv hit's time goes (ms, medians; sources in the report's profile_sources):")
    print(format_table(report["profiles"], PROFILE_COLUMNS))
    print("\n" + format_targets(report["targets"]))
    for line in report["not_measured"]:
        print(f"not measured: {line}")
    save_report(report, args.out, plot_report, no_plot=args.no_plot)
    status = EXIT_OK
    for row in report["rows"]:
        if row["connector"].startswith("HybridStoreConnector") and not row["loaded_bytes"]:
            print(f"problem: {row['family']}: the external hit loaded no bytes", file=sys.stderr)
            status = EXIT_PROBLEM
    return status


def _with_spreads(row: dict[str, Any]) -> dict[str, Any]:
    """``*_spread`` [min, max] lists as ``min..max`` cells."""
    return row | {
        key: "..".join(format_cell(v) for v in value)
        for key, value in row.items()
        if key.endswith("_spread") and isinstance(value, list)
    }


def handle_lookup(args: argparse.Namespace) -> int:
    from hybridkv.bench.report import save_report
    from hybridkv.bench.store import bench_scratch_dir
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR

    from hybridkv_dev.bench.lookup import DEFAULT_GEOMETRIES, run_lookup_bench
    from hybridkv_dev.bench.lookup import TABLE_COLUMNS as LOOKUP_COLUMNS
    from hybridkv_dev.bench.lookup import plot_report as plot_lookup

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
    print(format_table(report["rows"], LOOKUP_COLUMNS))
    save_report(report, args.out, plot_lookup, no_plot=args.no_plot)
    return EXIT_OK


def _inflight_wanted(args: argparse.Namespace) -> bool | None:
    """Whether ``bench scheduler`` runs the may_load_async axis (``--inflight``; by default where vLLM has
    the hook); ``None`` after printing a usage error."""
    from hybridkv_dev.bench.scheduler_inflight import inflight_unavailable_reason

    if args.inflight_hits < 1 or args.inflight_load_steps < 1 or args.inflight_cap < 1:
        print("error: need --inflight-hits, --inflight-load-steps and --inflight-cap >= 1", file=sys.stderr)
        return None
    reason = inflight_unavailable_reason() if args.inflight is not False else None
    if reason is not None and args.inflight:
        print(f"error: --inflight: {reason}", file=sys.stderr)
        return None
    if reason is not None:
        print(f"note: no may_load_async axis (--no-inflight to silence): {reason}", file=sys.stderr)
    return args.inflight is not False and reason is None


def _inflight_axis(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Run and print ``bench scheduler``'s may_load_async axis: (its report, exit status)."""
    from hybridkv_dev.bench.scheduler_inflight import INFLIGHT_COLUMNS, InflightSettings, run_inflight_bench

    settings = InflightSettings(
        num_hits=args.inflight_hits, load_steps=args.inflight_load_steps, inflight_loads=args.inflight_cap
    )
    report = run_inflight_bench(settings, num_rounds=args.rounds)
    print(
        f"\nmay_load_async: {report['geometry']}; {report['settings']}; {args.rounds} interleaved rounds; "
        "steps from arrival to first scheduled token (medians over rounds of each run's median, spread min..max)"
    )
    print(format_table(report["rows"], INFLIGHT_COLUMNS))
    print(
        f"steps to first token saved by may_load_async (per round, off - on): {report['steps_saved_p50']:g} "
        f"(spread {report['steps_saved_spread']})"
    )
    status = EXIT_OK
    for row in report["rows"]:
        if not row["hits_loaded"]:
            print(f"problem: may_load_async: {row['arm']}: no hit request loaded", file=sys.stderr)
            status = EXIT_PROBLEM
    return report, status


def handle_scheduler(args: argparse.Namespace) -> int:
    from hybridkv.bench.report import format_targets, save_report
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR
    from hybridkv.store.url import store_kind

    from hybridkv_dev.bench.scheduler import (
        HOOK_COLUMNS,
        PEER_CONNECTOR,
        SCHEDULER_COLUMNS,
        PeerSpec,
        hook_rows,
        peer_lookup_server,
        peer_unavailable_reason,
        run_scheduler_bench,
    )
    from hybridkv_dev.devkit.delayed_mooncake import DelayedMooncake, delayed_mooncake

    if (
        args.requests < 1
        or args.max_tokens < 4096
        or args.per_step < 1
        or args.rounds < 1
        or args.forward_ms < 0
        or args.idle_steps < 0
    ):
        print(
            "error: need --requests >= 1, --max-tokens >= 4096, --per-step >= 1, --rounds >= 1, "
            "--forward-ms >= 0, --idle-steps >= 0",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if any(delay < 0 for delay in [*args.mooncake_delay_ms, args.peer_delay_ms]):
        print("error: --mooncake-delay-ms and --peer-delay-ms must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    with_inflight = _inflight_wanted(args)
    if with_inflight is None:
        return EXIT_USAGE
    with_peer = args.peer
    reason = peer_unavailable_reason() if with_peer is not False else None
    if reason is not None:
        if with_peer:
            print(f"error: --peer ({PEER_CONNECTOR}): {reason}", file=sys.stderr)
            return EXIT_USAGE
        print(f"note: no {PEER_CONNECTOR} rows (--no-peer to silence): {reason}", file=sys.stderr)
    with_peer = with_peer is not False and reason is None
    urls = args.stores or [f"faulty+memory://bench-sched-{uuid.uuid4().hex[:8]}?delay_ms=5"]
    models_dir = Path(args.models_dir) if args.models_dir else DEFAULT_MODELS_DIR
    labels: dict[str, str] = {}
    peer = None
    with contextlib.ExitStack() as deployments:
        by_delay: dict[float, DelayedMooncake] = {}
        delays = [*args.mooncake_delay_ms, *([args.peer_delay_ms] if with_peer else [])]
        for delay_ms in delays:
            if delay_ms in by_delay:
                continue
            try:
                deployment = deployments.enter_context(delayed_mooncake(delay_ms))
            except RuntimeError as error:
                print(f"error: Mooncake deployment (+{delay_ms:g} ms): {error}", file=sys.stderr)
                return EXIT_USAGE
            by_delay[delay_ms] = deployment
            urls.append(deployment.url)
            labels[deployment.url] = f"mooncake (master +{delay_ms:g} ms each way)"
        if with_peer:
            deployment = by_delay[args.peer_delay_ms]
            try:
                server = deployments.enter_context(peer_lookup_server(deployment.proxy_address, models_dir))
            except RuntimeError as error:
                print(f"problem: {PEER_CONNECTOR}: {error}", file=sys.stderr)
                return EXIT_PROBLEM
            peer = PeerSpec(server, deployment.url, f"master +{args.peer_delay_ms:g} ms each way")
        report = run_scheduler_bench(
            urls,
            labels=labels,
            num_requests=args.requests,
            max_tokens=args.max_tokens,
            per_step=args.per_step,
            num_rounds=args.rounds,
            forward_ms=args.forward_ms,
            idle_steps=args.idle_steps,
            peer=peer,
            lookup_process_urls=[url for url in urls if not store_kind(url).process_local]
            if args.lookup_process
            else (),
            models_dir=models_dir,
        )
    print(
        f"{report['geometry']}; {report['num_requests']} requests up to {report['max_prompt_tokens']} tokens; "
        f"{report['num_rounds']} interleaved rounds (medians, spread min..max), "
        f"{report['forward_ms']} ms between schedule() calls, {report['idle_steps']} idle steps after the stream"
    )
    print(format_table(report["rows"], SCHEDULER_COLUMNS))
    print(
        "\nthe connector's scheduler-thread calls (ms per call; wall, and the thread's CPU; medians over rounds):"
    )
    print(format_table(hook_rows(report["rows"]), HOOK_COLUMNS))
    report["inflight"], status = _inflight_axis(args) if with_inflight else (None, EXIT_OK)
    print("\n" + format_targets(report["targets"]))
    save_report(report, args.out, lambda _report, _path: None, no_plot=True)
    for row in report["rows"][1:]:
        if row["connector"] == "hybridkv" and row["hit_tokens"] != row["full_scan_hit_tokens"]:
            print(f"problem: {row['store']}: hit tokens differ from the full scan", file=sys.stderr)
            status = EXIT_PROBLEM
        if row["connector"] == "peer" and not row["hit_tokens"]:
            print(f"problem: {row['store']}: found no hit on the planted prefixes", file=sys.stderr)
            status = EXIT_PROBLEM
    return status
