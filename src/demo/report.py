"""``hybridkv demo``: the seed scenario on a real vLLM engine, rendered for an operator.

The logic lives in :mod:`hybridkv.demo` (``run_demo`` returns a ``DemoReport``); this module parses the
flags, prepares the process for an in-process vLLM engine (environment variables, quiet vLLM logging on
stderr), shows progress on stderr, and renders the report: one table per phase, or JSON with ``--json``.
vLLM is imported only when the command runs, so ``hybridkv --help`` stays fast.

Exit codes: 0 every phase behaved and the audit log is clean; 1 something did not (the output says
what); 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.cli._output import format_table, write_json
from hybridkv.connector.tiny_models import FAMILIES

if TYPE_CHECKING:
    from hybridkv.demo import DemoReport, PhaseResult, RequestResult

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

_COLUMNS = [
    "request",
    "prompt",
    "cached",
    "local",
    "external",
    "loaded",
    "saved",
    "truncated",
    "failed keys",
    "tokens",
]


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    """Add ``demo`` to ``subparsers`` (no benchmark)."""
    del bench_subparsers
    demo = subparsers.add_parser(
        "demo",
        help="run the seed scenario on a real vLLM engine with a tiny hybrid model",
        description=(
            "Build a tiny random-weight model (no download), start vLLM in-process with the hybridkv "
            "connector on a store (a fresh file store by default), and show: a cold prompt saved to the "
            "store; a shared-prefix hit; the local prefix cache dropped and the prompt restored from the "
            "store with identical tokens; the same on a fresh engine; the same under a chaos store "
            "(failed and corrupt reads). Ends by auditing the connector's transition log. "
            "Exit 0 only if every phase behaved."
        ),
    )
    demo.add_argument(
        "--model-family",
        choices=FAMILIES,
        default="qwen3_next",
        help="tiny model family (default: %(default)s)",
    )
    demo.add_argument(
        "--store",
        metavar="URL",
        help="store URL (file://, memory://, mooncake://; default: a file store in the work dir). "
        "Each run uses its own namespace, so it starts cold on a reused store too",
    )
    demo.add_argument(
        "--prompt-tokens",
        type=int,
        default=1200,
        metavar="N",
        help="length of prompt A (default: %(default)s)",
    )
    demo.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="tokens generated per request (default: %(default)s)",
    )
    demo.add_argument(
        "--workdir", metavar="DIR", help="where the model, store and audit log go (default: a fresh temp dir)"
    )
    demo.add_argument(
        "--models-dir", metavar="DIR", help="where tiny models are built or reused (default: WORKDIR/models)"
    )
    demo.add_argument(
        "--chaos",
        default=None,
        metavar="QUERY",
        help="fault parameters of the chaos phase's faulty+ store (default: get_fail=0.5&corrupt=0.2&seed=7)",
    )
    demo.add_argument(
        "--chaos-rounds",
        type=int,
        default=2,
        metavar="N",
        help="requests in the chaos phase (default: %(default)s)",
    )
    demo.add_argument(
        "--json", action="store_true", help="print a machine-readable summary on stdout instead of tables"
    )
    demo.set_defaults(func=handler)


def _prepare_environment(log_level: str) -> None:
    """In-process vLLM, offline, no telemetry, its log on stderr (quiet unless --log-level INFO/DEBUG).
    Values already set by the user win, except multiprocessing: the demo reads the connector's counters
    from the in-process engine."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    vllm_level = os.environ.setdefault(
        "VLLM_LOGGING_LEVEL", log_level if log_level in ("DEBUG", "INFO") else "ERROR"
    )
    # Some vLLM modules log while it is still importing, before its own logging config applies.
    logging.getLogger("vllm").setLevel(getattr(logging, vllm_level.upper(), logging.ERROR))
    os.environ.setdefault("TQDM_DISABLE", "1")
    # Deprecation chatter from torch/vLLM internals says nothing about the demo.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")


class _Progress:
    """``[  4.2s] message`` lines on stderr."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def handler(args: argparse.Namespace) -> int:
    """Run the demo; print tables (or JSON); return the exit code."""
    from hybridkv.demo import DEFAULT_CHAOS, DemoOptions, run_demo

    options = DemoOptions(
        model_family=args.model_family,
        store=args.store,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        workdir=Path(args.workdir) if args.workdir else None,
        models_dir=Path(args.models_dir) if args.models_dir else None,
        chaos=args.chaos if args.chaos is not None else DEFAULT_CHAOS,
        chaos_rounds=args.chaos_rounds,
        progress=_Progress(),
    )
    try:
        options.validate()
    except ValueError as error:
        print(f"hybridkv demo: {error}", file=sys.stderr)
        return EXIT_USAGE
    # Only a valid run touches the process environment (vLLM reads it when it is first imported).
    _prepare_environment(getattr(args, "log_level", "WARNING"))
    report = run_demo(options)
    summary = report.to_dict()
    summary_path = write_json(Path(report.workdir) / "demo-report.json", summary)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True, default=str))
    else:
        print(render(report, summary_path))
    if getattr(args, "log_level", "WARNING") == "DEBUG":
        for phase in report.phases:
            if phase.traceback:
                print(f"--- phase {phase.name} ---\n{phase.traceback}", file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_PROBLEM


# -- rendering --------------------------------------------------------------------------------------


def _size(n: int) -> str:
    if n <= 0:
        return "0"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _tokens_cell(r: RequestResult, phase: PhaseResult) -> str:
    if r.tokens_match is None:
        return "reference" if phase.name == "cold" else "-"
    return "same" if r.tokens_match else "DIFFERENT"


def _row(r: RequestResult, phase: PhaseResult) -> dict[str, Any]:
    return {
        "request": r.label,
        "prompt": r.prompt_tokens,
        "cached": r.cached_tokens,
        "local": r.local_hit_tokens,
        "external": r.external_hit_tokens,
        "loaded": _size(r.loaded_bytes),
        "saved": _size(r.saved_bytes),
        "truncated": r.truncations,
        "failed keys": r.failed_keys,
        "tokens": _tokens_cell(r, phase),
    }


def render(report: DemoReport, summary_path: Path | None = None) -> str:
    """The operator-facing text: a header, one table and its checks per phase, the audit, the verdict."""
    lines: list[str] = []
    geo = report.geometry
    lines.append(f"hybridkv demo: tiny random-weight {report.model_family} model on vLLM (in-process)")
    lines.append(f"  store      {report.store}")
    lines.append(f"  chaos      {report.chaos_store}")
    lines.append(f"  namespace  {report.namespace}")
    if geo:
        lines.append(f"  groups     {'; '.join(geo.get('groups', []))}")
        lines.append(f"  hits align to {geo.get('hit_alignment')} tokens (hash unit {geo.get('hash_unit')})")
    lines.append(
        "  columns    cached = vLLM's num_cached_tokens = local (device prefix cache) + external (loaded "
        "from the store and verified); loaded / saved = bytes read from / written to the store (bytes "
        "read for a truncated load are discarded); failed keys = reads that failed or were corrupt"
    )
    for number, phase in enumerate(report.phases, start=1):
        lines.append("")
        verdict = "ok" if phase.ok else "FAILED"
        lines.append(f"{number}. {phase.title}  [{verdict}]")
        if phase.requests:
            table = format_table([_row(r, phase) for r in phase.requests], _COLUMNS)
            lines.extend("   " + line for line in table.splitlines())
        for check in phase.checks:
            lines.append(f"   {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    lines.append("")
    audit = report.audit
    if audit is None:
        lines.append("audit: not run")
    elif "error" in audit:
        lines.append(f"audit: FAILED: {audit['error']}")
    else:
        counts = audit.get("violation_counts") or {}
        lines.append(
            f"audit: {report.audit_log}: {audit.get('num_records')} records, {audit.get('num_lifecycles')} "
            f"lifecycles, {audit.get('num_truncations')} truncations, {audit.get('num_retries')} retries, "
            f"{len(audit.get('violations', []))} violations -> {'clean' if report.audit_ok else 'NOT CLEAN'}"
        )
        if counts:
            lines.append(f"   violations by kind: {counts}")
        for v in audit.get("violations", [])[:5]:
            lines.append(
                f"   line {v.get('line')}: {v.get('kind')} {v.get('request_id')}: {v.get('message')}"
            )
        lines.append(f"   re-check: hybridkv audit {report.audit_log}")
    if report.error:
        lines.append(f"error: {report.error}")
    total = report.timings.get("total_s")
    lines.append(
        f"result: {'PASS' if report.ok else 'FAIL'}"
        + (f" in {total:.0f}s" if total is not None else "")
        + f"; work dir {report.workdir}"
        + (f"; summary {summary_path}" if summary_path else "")
    )
    return "\n".join(lines)
