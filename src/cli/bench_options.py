"""The flags the ``hybridkv bench ...`` commands share, each written once: the report (``--out``,
``--no-plot``), the rounds and their seed, where models, stores and logs go.

Building the parser imports nothing of the benches (``tests/static/test_layers.py``): a bench's own defaults
that a flag shows are passed in by its command module.
"""

from __future__ import annotations

import argparse


def add_report_arguments(parser: argparse.ArgumentParser, default_out: str, *, plot: bool = True) -> None:
    """A bench's ``--out`` (its JSON report) and, with ``plot``, ``--no-plot`` (the PNG next to it)."""
    parser.add_argument("--out", default=default_out, help="JSON report path (%(default)s)")
    if plot:
        parser.add_argument(
            "--no-plot", action="store_true", help="skip the PNG even if matplotlib is installed"
        )


def add_rounds_argument(parser: argparse.ArgumentParser, *, default: int, help: str) -> None:
    """``--rounds``: how many rounds the bench runs (``help`` says what one round is)."""
    parser.add_argument("--rounds", type=int, default=default, help=f"{help} (%(default)s)")


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    """``--seed``: the seed of round 0's trace (round ``r`` runs ``seed + r``)."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the first round's trace (%(default)s)")


def add_family_argument(parser: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    """``--family``: the tiny model family the servers run (``qwen3_next``, the hybrid, by default)."""
    parser.add_argument("--family", default="qwen3_next", choices=choices, help="model family (%(default)s)")


def add_models_dir_argument(
    parser: argparse.ArgumentParser, help: str = "where models are built (default: $HYBRIDKV_TEST_MODELS)"
) -> None:
    """``--models-dir``: where the bench builds (or reuses) its tiny models."""
    parser.add_argument("--models-dir", default=None, help=help)


def add_scratch_dir_argument(
    parser: argparse.ArgumentParser,
    help: str = "directory for the file stores (default: /dev/shm when present)",
) -> None:
    """``--scratch-dir``: where the bench's file stores live."""
    parser.add_argument("--scratch-dir", default=None, help=help)


def add_workdir_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--workdir``: where ``what`` (the servers' logs, stores, audit logs) go; a temp dir by default."""
    parser.add_argument("--workdir", default=None, help=f"{what} (default: a temp dir)")
