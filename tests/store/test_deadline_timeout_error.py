"""Only an expired deadline is a missed deadline (issue 34, item 8b).

On Python 3.11+ ``TimeoutError`` is ``concurrent.futures.TimeoutError``, the class a future's timed wait
raises: a call that itself raises ``TimeoutError`` (a socket's, or ``OSError`` ``ETIMEDOUT``) must come back
as that call's failure -- never logged and counted as a call abandoned at its deadline. The Mooncake side of
this is in ``test_breaker_probe.py``.
"""

from __future__ import annotations

import threading
from typing import NoReturn

import pytest
from hybridkv.store.base import StoreLogEvent, collect_late_calls
from hybridkv.store.breaker import DeadlineExceeded, DeadlineRunner
from hybridkv.store.file.deadline import DeadlineGuard
from structlog.testing import capture_logs

#: A deadline no test call comes near unless it hangs.
DEADLINE_S = 1.0
#: A bound on waits that must end (a hang guard, never a timing claim).
GUARD_S = 30.0


def _raises_timeout() -> NoReturn:
    raise TimeoutError("the call's own timeout")


def test_a_call_raising_timeout_error_is_re_raised_not_abandoned() -> None:
    runner = DeadlineRunner(name="test-timeout-error")
    try:
        with pytest.raises(TimeoutError, match="the call's own timeout") as raised:
            runner.run(_raises_timeout, DEADLINE_S)
        assert not isinstance(raised.value, DeadlineExceeded)
        assert runner.num_abandoned == 0, "a call that raised did not miss its deadline"
    finally:
        runner.shutdown()


def test_a_call_past_its_deadline_is_still_abandoned() -> None:
    runner = DeadlineRunner(name="test-timeout-error")
    release = threading.Event()
    try:
        with pytest.raises(DeadlineExceeded) as raised:
            runner.run(lambda: release.wait(GUARD_S), 0.05)
        assert runner.num_abandoned == 1
        release.set()
        assert raised.value.done.result(timeout=GUARD_S) is True
    finally:
        release.set()
        runner.shutdown()


def test_the_file_guard_reports_a_call_raising_timeout_error_as_that_call_s_failure() -> None:
    guard = DeadlineGuard(url="file:///unused", fstype="nfs4", timeout_ms=int(DEADLINE_S * 1000))
    with (
        capture_logs() as logs,
        collect_late_calls() as late,
        pytest.raises(TimeoutError, match="the call's own timeout"),
    ):
        guard.run("get", 2, _raises_timeout)
    assert guard.num_abandoned == 0, "counted as a call past its deadline"
    assert late == [], "a call that returned (by raising) hands back no late handle"
    assert [entry for entry in logs if entry["event"] == StoreLogEvent.FILE_DEADLINE] == []
    assert guard.shutdown(), "the call returned: nothing of it is still running"
