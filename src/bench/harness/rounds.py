"""Rounds of a bench and the order of its arms in each, and what else ran on the host meanwhile.

A bench that compares arms (configurations, connectors, stores) runs them round after round; on a shared host
the load drifts, so no arm may always run first or last: round ``r`` runs the arms rotated left by ``r``
(``rotated``), and the report states the host's 1-minute load average at the start and the end
(``load_average``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

Arm = TypeVar("Arm")


def rotated(arms: Sequence[Arm], round_index: int) -> list[Arm]:
    """``arms`` rotated left by ``round_index``: the order of round ``round_index`` of a repeated bench, so
    each arm takes each place in turn."""
    shift = round_index % len(arms) if arms else 0
    return [*arms[shift:], *arms[:shift]]


def interleaved(arms: Sequence[Arm], num_rounds: int) -> Iterator[tuple[int, Arm]]:
    """``(round_index, arm)`` for every arm of every round, round after round, each round in its ``rotated``
    order."""
    assert num_rounds >= 0, f"num_rounds {num_rounds} < 0"
    for round_index in range(num_rounds):
        for arm in rotated(arms, round_index):
            yield round_index, arm


def load_average() -> float:
    """The host's 1-minute load average now."""
    return os.getloadavg()[0]


def load_change(at_start: float) -> str:
    """The host's 1-minute load average at a measurement's start and now, as ``start->end``: on a shared
    host other jobs' load inflates every arm of a round (a difference of two arms is taken per round)."""
    return f"{at_start:.1f}->{load_average():.1f}"
