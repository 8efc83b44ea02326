"""Session hints (``hybridkv.connector.sessions``): every value a client can send parses or is refused by
name, never raises."""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.connector.sessions import MAX_SESSION_TTL_S, SESSION_PARAM, SessionHint, parse_session_hint
from hypothesis import given
from hypothesis import strategies as st

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@given(
    st.one_of(
        JSON,
        st.fixed_dictionaries({SESSION_PARAM: JSON}),
        st.fixed_dictionaries(
            {SESSION_PARAM: st.fixed_dictionaries({"id": JSON, "ttl_s": JSON}, optional={"end": JSON})}
        ),
    )
)
def test_any_value_parses_or_is_refused_by_name(params: Any) -> None:
    hint, reason = parse_session_hint(params)
    assert hint is None or reason is None
    if hint is not None:
        assert hint.session_id and 0 < hint.ttl_s <= MAX_SESSION_TTL_S and isinstance(hint.end, bool)
    if reason is not None:
        assert reason.startswith(SESSION_PARAM), reason


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ("chat", "must be an object"),
        ({"id": "", "ttl_s": 5}, ".id"),
        ({"id": 3, "ttl_s": 5}, ".id"),
        ({"id": "x" * 257, "ttl_s": 5}, ".id"),
        ({"id": "s", "ttl_s": -1}, ".ttl_s"),
        ({"id": "s", "ttl_s": 0}, ".ttl_s"),
        ({"id": "s", "ttl_s": float("nan")}, ".ttl_s"),
        ({"id": "s", "ttl_s": MAX_SESSION_TTL_S + 1}, ".ttl_s"),
        ({"id": "s", "ttl_s": True}, ".ttl_s"),
        ({"id": "s", "ttl_s": "600"}, ".ttl_s"),
        ({"id": "s", "ttl_s": 5, "end": "yes"}, ".end"),
        ({"id": "s", "ttl_s": 5, "pin": True}, "unknown key 'pin'"),
    ],
)
def test_each_bad_hint_is_refused_naming_its_key(raw: Any, named: str) -> None:
    hint, reason = parse_session_hint({SESSION_PARAM: raw})
    assert hint is None and reason is not None and named in reason, reason


def test_good_hints_and_no_hint() -> None:
    assert parse_session_hint(None) == (None, None)
    assert parse_session_hint({"other": 1}) == (None, None)
    assert parse_session_hint({SESSION_PARAM: {"id": "s", "ttl_s": 600}}) == (SessionHint("s", 600.0), None)
    assert parse_session_hint({SESSION_PARAM: {"id": "s", "ttl_s": 1.5, "end": True}}) == (
        SessionHint("s", 1.5, True),
        None,
    )
