"""``hybridkv bench datapath``: the connector's block data path (gather / scatter) vs a plain copy.

The benchmark owns its flags (``hybridkv.bench.datapath.main``, also ``python -m hybridkv.bench.datapath``
on a bare GPU host); this command forwards every argument to it, so registering imports nothing of the
bench and torch is imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse

from hybridkv.cli.exit_codes import ExitCode


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``datapath`` to ``bench_subparsers``."""
    bench = bench_subparsers.add_parser(
        "datapath",
        help="block gather/scatter GB/s (device<->pinned host on CUDA) vs one contiguous copy",
        description="Gather (device -> pinned host) and scatter (pinned host -> device) throughput of the "
        "connector's BlockMover for realistic KV geometries and batch sizes, next to one contiguous copy "
        "of the same bytes measured in the same run (CPU: np.copyto). Writes a JSON report.",
        # Every argument (--help too) goes to the bench's own parser: with no '-' prefix here, argparse
        # takes '--device cpu ...' as plain words for ``forwarded``.
        add_help=False,
        prefix_chars="+",
    )
    bench.add_argument("forwarded", nargs="*", help=argparse.SUPPRESS)
    bench.set_defaults(func=handle_bench)


def handle_bench(args: argparse.Namespace) -> int:
    try:
        from hybridkv.bench import datapath
    except ModuleNotFoundError as error:
        print(f"error: bench datapath needs {error.name}", flush=True)
        return ExitCode.USAGE
    return datapath.main(args.forwarded, prog="hybridkv bench datapath")
