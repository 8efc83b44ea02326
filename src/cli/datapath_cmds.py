"""``hybridkv bench datapath``: the connector's block data path (gather / scatter) vs a plain copy.

Registering imports nothing heavy; torch is imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse

EXIT_USAGE = 2


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``datapath`` to ``bench_subparsers`` (no top-level command)."""
    bench = bench_subparsers.add_parser(
        "datapath",
        help="block gather/scatter GB/s (device<->pinned host on CUDA) vs one contiguous copy",
        description="Gather (device -> pinned host) and scatter (pinned host -> device) throughput of the "
        "connector's BlockMover for realistic KV geometries and batch sizes, next to one contiguous copy "
        "of the same bytes measured in the same run (CPU: np.copyto). Writes a JSON report.",
    )
    bench.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda if available; %(default)s)")
    bench.add_argument("--out", default="bench-results", help="report directory or .json path (%(default)s)")
    bench.add_argument("--batches", default="16,64,256", help="blocks per batch (%(default)s)")
    bench.add_argument("--geometries", default="attn,mamba", help="comma-separated, of attn, mamba")
    bench.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; best kept")
    bench.add_argument("--stage-mib", type=int, default=32, help="device staging buffer MiB (%(default)s)")
    bench.add_argument("--no-per-page", action="store_true", help="skip the naive per-page copy baseline")
    bench.set_defaults(func=handle_bench)


def handle_bench(args: argparse.Namespace) -> int:
    try:
        from hybridkv.connector.datapath_bench import run_from_args
    except ModuleNotFoundError as error:
        print(f"error: bench datapath needs {error.name}", flush=True)
        return EXIT_USAGE
    return int(run_from_args(args))
