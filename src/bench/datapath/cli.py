"""The data-path bench's command line (``python -m hybridkv.bench.datapath``, ``hybridkv bench datapath``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridkv.bench.datapath.bench import run_bench
from hybridkv.bench.datapath.cases import GEOMETRIES
from hybridkv.bench.datapath.table import BESIDE_COLUMNS, format_table, write_report
from hybridkv.bench.report import format_targets

# The exit codes of ``hybridkv`` (``hybridkv.cli.exit_codes``; the bench does not import the CLI).
_EXIT_OK = 0
_EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``hybridkv bench datapath`` forwards its arguments to :func:`main`)."""
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda if available; %(default)s)")
    parser.add_argument("--out", default="bench-results", help="report directory or .json path (%(default)s)")
    parser.add_argument("--batches", default="16,64,256", help="blocks per batch (%(default)s)")
    parser.add_argument("--geometries", default="attn,mamba", help="comma-separated, of attn, mamba")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved timed rounds per measurement; medians and spread reported",
    )
    parser.add_argument("--stage-mib", type=int, default=32, help="device staging buffer MiB (%(default)s)")
    parser.add_argument("--no-per-page", action="store_true", help="skip the naive per-page copy baseline")
    parser.add_argument(
        "--no-beside-compute",
        action="store_true",
        help="CUDA: skip timing a matmul loop with each path's transfers running beside it",
    )


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m hybridkv.bench.datapath") -> int:
    """The benchmark's command line: ``python -m hybridkv.bench.datapath`` on a host with only torch and
    numpy, and ``hybridkv bench datapath`` (which forwards its arguments here, ``prog`` naming it)."""
    from hybridkv.bench import datapath  # the package's docstring is the command's description

    parser = argparse.ArgumentParser(
        prog=prog, description=datapath.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed
        return int(exit_.code or 0)
    try:
        batches = [int(x) for x in str(args.batches).split(",") if x.strip()]
    except ValueError as error:
        print(f"error: bad --batches: {error}", file=sys.stderr)
        return _EXIT_USAGE
    geometries = [x.strip() for x in str(args.geometries).split(",") if x.strip()]
    unknown = [g for g in geometries if g not in GEOMETRIES]
    if unknown or not batches or min(batches) < 1:
        print(f"error: bad --geometries {unknown} or --batches {batches}", file=sys.stderr)
        return _EXIT_USAGE
    try:
        report = run_bench(
            str(args.device),
            geometries=geometries,
            batches=batches,
            repeats=args.repeats,
            stage_bytes=args.stage_mib << 20,
            per_page=not args.no_per_page,
            beside_compute=not args.no_beside_compute,
        )
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    print(format_table(report["rows"]))
    if report["beside_compute"]:
        print(format_table(report["beside_compute"], BESIDE_COLUMNS))
    if report["targets"]:
        print("\n" + format_targets(report["targets"]))
    print(f"report: {write_report(report, args.out)}")
    return _EXIT_OK
