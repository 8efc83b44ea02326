"""The ``hybridkv`` command.

Each subsystem registers its own subcommands (``register(subparsers, bench_subparsers)``, or
``register_bench(bench_subparsers)`` for benchmarks only); this module only
builds the parser, configures logging for the process (the library itself never does) and maps outcomes to
exit codes (one set for every command, :class:`hybridkv.cli.exit_codes.ExitCode`):

- 0: success
- 1: the command ran and found a problem (an audit violation, a failed check)
- 2: bad usage or bad input (unknown flag, malformed store URL, missing file)
- 130: interrupted (Ctrl-C)
- 141: stdout's reader went away (``hybridkv audit FILE | head``): the command stops quietly, as ``cat``
  stopped by SIGPIPE does, without a traceback
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from hybridkv import __version__
from hybridkv.cli.bench_options import add_report_arguments
from hybridkv.cli.exit_codes import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

__all__ = ["EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "add_report_arguments", "build_parser", "main"]

#: The entry point group through which installed distributions add commands (the development distribution's
#: benches among them): each entry point's value names a module with ``register`` or ``register_bench``.
COMMANDS_ENTRY_POINT_GROUP = "hybridkv.commands"

# The product's modules that contribute subcommands. Each defines
# ``register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None``
# or, when it adds benchmarks only, ``register_bench(bench_subparsers: argparse._SubParsersAction) -> None``,
# and sets ``func`` on its parsers via ``set_defaults(func=...)``; ``func(args) -> int`` returns the exit code.
_COMMAND_MODULES = (
    "hybridkv.cli.store_cmds",
    "hybridkv.cli.lifecycle_cmds",
    "hybridkv.cli.demo_cmds",
    "hybridkv.cli.datapath_cmds",
    "hybridkv.cli.describe_cmds",
    "hybridkv.cli.mooncake_cmds",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridkv",
        description=(
            "hybridkv: an external prefix-cache tier for vLLM that stays correct for hybrid models.\n"
            "Run `hybridkv demo` to see it work, `hybridkv audit FILE` to check a transition log."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="level of the process log on stderr (default: WARNING)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: JSON + table output, ratios against a baseline measured in the same run",
        description="Benchmarks. Each writes a JSON report (and a PNG plot when matplotlib is present).",
    )
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(func=lambda _args: _missing_subcommand(bench))
    for module_name in (*_COMMAND_MODULES, *_plugin_command_modules()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # Only a missing command module itself is tolerated; a missing dependency inside it is a bug.
            if error.name != module_name:
                raise
            continue
        if hasattr(module, "register_bench"):
            module.register_bench(bench_subparsers)
        else:
            module.register(subparsers, bench_subparsers)
    return parser


def _plugin_command_modules() -> list[str]:
    """The command modules installed distributions declare (``COMMANDS_ENTRY_POINT_GROUP``), by name."""
    from importlib.metadata import entry_points

    return sorted(entry_point.value for entry_point in entry_points(group=COMMANDS_ENTRY_POINT_GROUP))


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` names; its exit code (see the module docstring). Whatever command it is, a
    reader of stdout that went away ends it quietly with 141."""
    try:
        code = _run(argv)
        # Flushed here, not at interpreter exit: a closed pipe seen there prints "Exception ignored".
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return code


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from hybridkv.cli._logging import configure_process_logging

    configure_process_logging(args.log_level)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(func(args))


def _drop_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for the gone reader would otherwise fail again
    when the interpreter flushes it at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file descriptor (a test's capture): nothing is flushed to a pipe at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
