"""The exit codes of every ``hybridkv`` command (one set; docs/development.md lists them)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a ``hybridkv`` command's exit status means."""

    #: the command did what was asked and found nothing wrong
    OK = 0
    #: the command ran and found a problem (an audit violation, a failed check, a stale file)
    PROBLEM = 1
    #: bad usage or bad input (unknown flag, malformed store URL, missing file or dependency)
    USAGE = 2
    #: interrupted by Ctrl-C (128 + SIGINT, as shells report it)
    INTERRUPTED = 130
    #: the reader of stdout went away (``hybridkv audit ... | head``): 128 + SIGPIPE, as shells report a
    #: command that a closed pipe stopped, quietly (no traceback)
    BROKEN_PIPE = 141


# The names the command modules use.
EXIT_OK = ExitCode.OK
EXIT_PROBLEM = ExitCode.PROBLEM
EXIT_USAGE = ExitCode.USAGE
EXIT_INTERRUPTED = ExitCode.INTERRUPTED
EXIT_BROKEN_PIPE = ExitCode.BROKEN_PIPE
