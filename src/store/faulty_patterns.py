"""The positional fault patterns of a ``faulty+`` view: where its calls fault by a key's position.

``OpPattern`` (one operation's gaps, tail and random gaps), ``FaultScope`` (the groups and ranks whose block
keys take positional faults) and ``FaultPatterns`` (all of them, with the run of failed calls) are plain
values; ``read_fault_patterns`` reads them from a URL's parameters and ``FaultPatterns.query`` writes the
parameters back (what reproduces a run). What each parameter means is told in ``hybridkv.store.faulty``,
whose ``FaultyBackend`` applies them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from hybridkv.key_grammar import parse_block_key
from hybridkv.store.params import Params

__all__ = [
    "MAX_PATTERN_NUMBER",
    "NO_PATTERNS",
    "PATTERN_OPS",
    "FaultPatterns",
    "FaultScope",
    "OpPattern",
    "read_fault_patterns",
]

#: The operations positional faults apply to (``<op>_gap``, ``<op>_tail``, ``<op>_random_gaps``, ``fail_ops``).
PATTERN_OPS = ("exists", "get", "put")

#: The largest position, count, group or rank a positional parameter takes: a signed 64-bit count (any
#: larger number is a typo).
MAX_PATTERN_NUMBER = (1 << 63) - 1
#: A comma-separated list of whole numbers in ASCII digits (no sign, no spaces, no empty item).
_NUMBER_LIST_RE = re.compile(r"[0-9]{1,19}(?:,[0-9]{1,19})*")
#: Stands for "not in the URL": ``Params.text`` refuses control characters, so no URL value equals it.
_ABSENT = "\x00absent"


@dataclass(frozen=True)
class OpPattern:
    """Where the calls of one operation fault by position (its ``_gap``, ``_tail``, ``_random_gaps``)."""

    #: 0-based positions, ascending, without repeats.
    gap: tuple[int, ...] = ()
    #: The fraction of a call's keys (from its end) that fault: the last ``ceil(tail * n)``.
    tail: float = 0.0
    num_random_gaps: int = 0

    def __post_init__(self) -> None:
        assert list(self.gap) == sorted(set(self.gap)) and all(p >= 0 for p in self.gap), (
            f"gap positions {self.gap} must ascend, unique and >= 0"
        )
        assert 0.0 <= self.tail <= 1.0, f"tail {self.tail} outside [0, 1]"
        assert self.num_random_gaps >= 0, f"num_random_gaps {self.num_random_gaps} < 0"

    @property
    def is_empty(self) -> bool:
        return not self.gap and self.tail == 0.0 and self.num_random_gaps == 0

    def num_tail(self, num_keys: int) -> int:
        """How many of the last of ``num_keys`` keys the tail takes: ``ceil(tail * num_keys)``."""
        # The decimal the URL wrote (``repr``), not the float's binary value: 0.1 * 10 keys is 1 key, not 2.
        return math.ceil(Fraction(repr(self.tail)) * num_keys)

    def query_items(self, op: str) -> list[tuple[str, str]]:
        """The URL parameters that give this pattern to ``op`` (none for the defaults)."""
        items = [(f"{op}_gap", ",".join(map(str, self.gap)))] if self.gap else []
        items += [(f"{op}_tail", repr(self.tail))] if self.tail else []
        items += [(f"{op}_random_gaps", str(self.num_random_gaps))] if self.num_random_gaps else []
        return items


@dataclass(frozen=True)
class FaultScope:
    """Which keys positional faults may hit (``fault_group``, ``fault_tp_rank``, ``fault_dcp_rank``):
    ``None`` matches every group / rank; once any is set, only block keys that match all of them."""

    groups: frozenset[int] | None = None
    tp_ranks: frozenset[int] | None = None
    dcp_ranks: frozenset[int] | None = None

    @property
    def is_everything(self) -> bool:
        return self.groups is None and self.tp_ranks is None and self.dcp_ranks is None

    def contains(self, key: str) -> bool:
        if self.is_everything:
            return True
        block = parse_block_key(key)
        return (
            block is not None
            and (self.groups is None or block.group_index in self.groups)
            and (self.tp_ranks is None or block.tp_rank in self.tp_ranks)
            and (self.dcp_ranks is None or block.dcp_rank in self.dcp_ranks)
        )

    def query_items(self) -> list[tuple[str, str]]:
        named = (
            ("fault_group", self.groups),
            ("fault_tp_rank", self.tp_ranks),
            ("fault_dcp_rank", self.dcp_ranks),
        )
        return [(name, ",".join(map(str, sorted(values)))) for name, values in named if values is not None]


@dataclass(frozen=True)
class FaultPatterns:
    """Every positional fault of a ``faulty+`` view (their meanings: ``hybridkv.store.faulty``); the
    default has none."""

    exists: OpPattern = OpPattern()
    get: OpPattern = OpPattern()
    put: OpPattern = OpPattern()
    #: Calls (of ``fail_ops``) that pass before the failed run.
    fail_after: int = 0
    #: Calls in the failed run; ``None``: every call after ``fail_after``.
    fail_calls: int | None = 0
    fail_ops: frozenset[str] = frozenset(PATTERN_OPS)
    scope: FaultScope = FaultScope()

    def __post_init__(self) -> None:
        assert self.fail_after >= 0 and (self.fail_calls is None or self.fail_calls >= 0), (
            f"fail_after {self.fail_after} / fail_calls {self.fail_calls} < 0"
        )
        assert self.fail_ops and self.fail_ops <= set(PATTERN_OPS), f"fail_ops {sorted(self.fail_ops)}"

    def of(self, op: str) -> OpPattern:
        """The pattern of ``op`` (one of ``PATTERN_OPS``)."""
        pattern: OpPattern = getattr(self, op)
        return pattern

    def numbers_calls_of(self, op: str) -> bool:
        """Whether ``op``'s calls are numbered for a failed run (there is one, and ``fail_ops`` names it)."""
        return self.fail_calls != 0 and op in self.fail_ops

    def fails_call(self, call_number: int) -> bool:
        """Whether the ``call_number``-th numbered call (from 1) is in the failed run."""
        if call_number <= self.fail_after:
            return False
        return self.fail_calls is None or call_number <= self.fail_after + self.fail_calls

    def query(self) -> str:
        """These patterns as ``faulty+`` URL parameters (``a=1&b=2``; empty for none): what reproduces them."""
        items = [item for op in PATTERN_OPS for item in self.of(op).query_items(op)]
        if self.fail_calls is None:  # ``fail_after`` alone: every call after it fails
            items.append(("fail_after", str(self.fail_after)))
        elif self.fail_calls:
            items += [("fail_after", str(self.fail_after))] if self.fail_after else []
            items.append(("fail_calls", str(self.fail_calls)))
        if self.fail_calls != 0 and self.fail_ops != frozenset(PATTERN_OPS):
            items.append(("fail_ops", ",".join(op for op in PATTERN_OPS if op in self.fail_ops)))
        items += self.scope.query_items()
        return "&".join(f"{name}={value}" for name, value in items)


NO_PATTERNS = FaultPatterns()


def _read_numbers(params: Params, name: str) -> tuple[int, ...] | None:
    """Parameter ``name`` as a comma-separated list of distinct whole numbers, ascending; None if absent."""
    value = params.text(name, _ABSENT)
    if value == _ABSENT:
        return None
    if not _NUMBER_LIST_RE.fullmatch(value):
        raise params.fail(name, value, "expected whole numbers >= 0, comma-separated, like 3 or 0,5")
    numbers = [int(item) for item in value.split(",")]
    if max(numbers) > MAX_PATTERN_NUMBER:
        raise params.fail(name, value, f"must be <= {MAX_PATTERN_NUMBER}")
    if len(set(numbers)) != len(numbers):
        repeated = next(number for number in numbers if numbers.count(number) > 1)
        raise params.fail(name, value, f"repeats {repeated}")
    return tuple(sorted(numbers))


def _read_fail_ops(params: Params) -> frozenset[str]:
    value = params.text("fail_ops", ",".join(PATTERN_OPS))
    ops = value.split(",")
    unknown = [op for op in ops if op not in PATTERN_OPS]
    if unknown:
        raise params.fail(
            "fail_ops", value, f"expected operations from {', '.join(PATTERN_OPS)}, comma-separated"
        )
    if len(set(ops)) != len(ops):
        raise params.fail("fail_ops", value, "repeats an operation")
    return frozenset(ops)


def read_fault_patterns(params: Params) -> FaultPatterns:
    """The positional parameters of a ``faulty+`` URL, read and checked (``StoreError`` naming a bad one)."""
    op_patterns = {
        op: OpPattern(
            gap=_read_numbers(params, f"{op}_gap") or (),
            tail=params.number(f"{op}_tail", 0.0, maximum=1.0),
            num_random_gaps=params.integer(f"{op}_random_gaps", 0, maximum=MAX_PATTERN_NUMBER),
        )
        for op in PATTERN_OPS
    }
    fail_after = params.optional_integer("fail_after", maximum=MAX_PATTERN_NUMBER)
    fail_calls = params.optional_integer("fail_calls", maximum=MAX_PATTERN_NUMBER)
    if fail_calls is None and fail_after is None:
        fail_calls = 0  # no failed run
    fail_ops = _read_fail_ops(params)

    def scope_part(name: str) -> frozenset[int] | None:
        numbers = _read_numbers(params, name)
        return None if numbers is None else frozenset(numbers)

    scope = FaultScope(scope_part("fault_group"), scope_part("fault_tp_rank"), scope_part("fault_dcp_rank"))
    return FaultPatterns(
        exists=op_patterns["exists"],
        get=op_patterns["get"],
        put=op_patterns["put"],
        fail_after=fail_after or 0,
        fail_calls=fail_calls,
        fail_ops=fail_ops,
        scope=scope,
    )
