"""``hybridkv demo``: the seed scenario on a real vLLM engine, rendered for an operator.

The scenario lives in :mod:`hybridkv.demo` (``run_demo`` returns a ``DemoReport``, ``render`` formats it);
this module parses the flags, prepares the process for an in-process vLLM engine, shows progress on stderr
and prints the report: one table per phase, or JSON with ``--json``. vLLM is imported only when the command
runs, so ``hybridkv --help`` stays fast.

Exit codes: 0 every phase behaved and the audit log is clean; 1 something did not (the output says
what); 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE


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
        default="qwen3_next",
        help="tiny model family: llama, gemma3, qwen3_next or lfm2 (default: %(default)s)",
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


class _Progress:
    """``[  4.2s] message`` lines on stderr."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def handler(args: argparse.Namespace) -> int:
    """Run the demo; print tables (or JSON); return the exit code."""
    from hybridkv.bench.report import write_json
    from hybridkv.demo import DEFAULT_CHAOS, DemoOptions, render, run_demo
    from hybridkv.ops.inprocess import prepare_inprocess_environment

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
    # vLLM's log on stderr, quiet unless --log-level INFO/DEBUG.
    log_level = getattr(args, "log_level", "WARNING")
    prepare_inprocess_environment(log_level if log_level in ("DEBUG", "INFO") else "ERROR", quiet=True)
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
