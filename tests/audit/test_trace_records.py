"""``hybridkv.audit.trace.records_to_trace`` called from Python: a record the trace cannot carry (a clock that
is NaN, infinite or beyond nanoseconds, a lone-surrogate request id) is skipped and counted by reason, as
``hybridkv audit --export vllm-trace`` skips it; never an exception mid-iteration."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
from hybridkv.audit.trace import SKIP_REASONS, hash_request_id, records_to_trace

_GOOD: dict[str, Any] = {
    "trigger": "lookup_miss",
    "request_id": "cmpl-1",
    "monotonic": 2.5,
    "src": "LOOKING_UP",
    "dst": "MISS",
}


@pytest.mark.parametrize(
    "monotonic",
    [math.nan, math.inf, -math.inf, 1e308, 10**400, -(10**400)],
    ids=["nan", "inf", "-inf", "1e308", "10**400", "-10**400"],
)
def test_a_clock_no_trace_line_holds_is_skipped_and_counted(monotonic: float) -> None:
    bad = {**_GOOD, "request_id": "cmpl-bad", "monotonic": monotonic}
    skipped: Counter[str] = Counter()
    traces = list(
        records_to_trace([_GOOD, bad, _GOOD], anchor_monotonic_s=2.5, anchor_wall_ns=10**18, skipped=skipped)
    )
    assert [t.request_id_hash for t in traces] == [hash_request_id("cmpl-1")] * 2
    assert all(t.monotonic_ns == 2_500_000_000 and t.wall_ns == 10**18 for t in traces)
    assert skipped == Counter({"unrepresentable": 1})


def test_every_reason_is_counted_and_the_counter_is_optional() -> None:
    records = [
        {**_GOOD, "request_id": "\udcff"},  # no UTF-8 text: unrepresentable
        {**_GOOD, "monotonic": "2.5"},  # a string clock: malformed
        {**_GOOD, "monotonic": True},  # a bool is no clock: malformed
        {k: v for k, v in _GOOD.items() if k != "request_id"},  # malformed
        {"event": "dropped", "num_dropped": 3, "monotonic": 1.0},  # a marker: no counterpart
        {**_GOOD, "trigger": "evict"},  # no trace event: no counterpart
        _GOOD,
    ]
    skipped: Counter[str] = Counter()
    traces = list(records_to_trace(records, anchor_monotonic_s=0.0, anchor_wall_ns=0, skipped=skipped))
    assert len(traces) == 1 and traces[0].event == "blocks_matched" and traces[0].block_count == 0
    assert skipped == Counter({"unrepresentable": 1, "malformed": 3, "no_counterpart": 2})
    assert set(skipped) <= set(SKIP_REASONS)
    assert len(list(records_to_trace(records, anchor_monotonic_s=0.0, anchor_wall_ns=0))) == 1


@pytest.mark.parametrize(
    ("anchor_monotonic_s", "anchor_wall_ns", "named"),
    [
        (math.nan, 0, "anchor_monotonic_s"),
        (math.inf, 0, "anchor_monotonic_s"),
        (10**400, 0, "anchor_monotonic_s"),
        ("1.0", 0, "anchor_monotonic_s"),
        (1.0, 1.5, "anchor_wall_ns"),
        (1.0, True, "anchor_wall_ns"),
    ],
)
def test_a_bad_anchor_is_refused_at_the_call_naming_it(
    anchor_monotonic_s: Any, anchor_wall_ns: Any, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        records_to_trace([_GOOD], anchor_monotonic_s=anchor_monotonic_s, anchor_wall_ns=anchor_wall_ns)
