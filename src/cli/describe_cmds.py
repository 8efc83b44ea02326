"""``hybridkv describe``: argument parsing, printing and exit codes over :mod:`hybridkv.ops.describe`.

What the report holds and how it reads as text is :mod:`hybridkv.ops.describe`'s; here: the flags, reading
``--config`` (JSON or ``@FILE``; a whole ``kv_transfer_config`` pasted gives its extra config), JSON or text
on stdout, errors on stderr, and the exit code (0: healthy, 1: the store is unreachable or absent, 2: bad
input).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.ops.describe import DescribeInputError, describe_deployment, render_text


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    """Add ``describe`` to ``subparsers`` (no bench)."""
    del bench_subparsers
    describe = subparsers.add_parser(
        "describe",
        help="geometry, fingerprint, store health, usage and entries of a deployment (read-only)",
        description="Describe a deployment's external tier from its kv_connector_extra_config (or a store "
        "URL) and, optionally, its model: the geometry vLLM resolves per group, the key fingerprint and "
        "namespace, the store's health (reachable, existence-check latency, breaker), usage and capacity, "
        "and entries per namespace and group. Never writes to the store. Exit 0: healthy, 1: the store is "
        "unreachable, absent or cannot write (a full file system), 2: bad input.",
    )
    describe.add_argument(
        "--config",
        metavar="JSON",
        help="the connector's kv_connector_extra_config as JSON, or @FILE to read it from a file",
    )
    describe.add_argument("--store", metavar="URL", help="store URL (overrides the config's `store`)")
    describe.add_argument(
        "--model",
        metavar="PATH",
        help="the served model: start an in-process vLLM engine to resolve the real KV-cache geometry",
    )
    describe.add_argument("--dtype", default="bfloat16", help="engine dtype with --model (%(default)s)")
    describe.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="engine attention backend with --model, as vLLM's --attention-backend (default: vLLM picks)",
    )
    describe.add_argument(
        "--max-model-len", type=int, default=2048, help="engine max_model_len with --model (%(default)s)"
    )
    describe.add_argument("--probes", type=int, default=5, help="existence checks to time (%(default)s)")
    describe.add_argument("--json", action="store_true", help="print one JSON object")
    describe.set_defaults(func=_describe)


def _describe(args: argparse.Namespace) -> int:
    """Run ``hybridkv describe``: print the report (JSON or text); exit 0 when the store is reachable and
    can write, 1 when not, 2 for bad input (named on stderr)."""
    try:
        extra = _read_config(args.config)
    except ValueError as error:
        return _bad_input(error)
    try:
        report = describe_deployment(
            extra,
            store=args.store,
            model=args.model,
            probes=args.probes,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
        )
    except DescribeInputError as error:
        return _bad_input(error)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(render_text(report))
    health = report["health"]
    return EXIT_OK if health["reachable"] and health.get("writable", True) else EXIT_PROBLEM


def _bad_input(error: ValueError) -> int:
    """Name the bad input on stderr; the usage exit code."""
    print(f"hybridkv describe: {error}", file=sys.stderr)
    return EXIT_USAGE


def _read_config(text: str | None) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` that ``--config`` gives (JSON text or ``@FILE``; ``{}`` without it);
    ``ValueError`` naming ``--config`` when it cannot be read or is not a JSON object."""
    if text is None:
        return {}
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"--config {text}: cannot read: {error.strerror}") from None
    try:
        extra = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--config: not JSON: {error}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--config: expected a JSON object (kv_connector_extra_config), got {extra!r}")  # noqa: TRY004
    # The whole kv_transfer_config pasted: take its extra config.
    nested = extra.get("kv_connector_extra_config")
    return dict(nested) if isinstance(nested, dict) else extra
