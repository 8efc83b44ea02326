"""Session hints (``hybridkv.connector.scheduler.sessions``): every value a client can send parses or is refused by
name, never raises; and what sessions retain in a real store: an entry stays retained while any live session
holds it, and a session's end releases only what it alone held."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from hybridkv.connector.scheduler.sessions import (
    MAX_SESSION_TTL_S,
    SESSION_PARAM,
    SessionHint,
    SessionRetention,
    parse_session_hint,
)
from hybridkv.connector.stats import StatsBox
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology
from hybridkv.store import open_store
from hybridkv.store.base import Status, Store
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


# --------------------------------------------------------------------------------------------------------
# Retention across sessions: a real memory store with a capacity, flooded with one-off entries.
# --------------------------------------------------------------------------------------------------------

#: About 64 one-KiB frames: a flood of 256 evicts every entry that is not retained.
_CAPACITY = "64KiB"
_PAYLOAD = b"k" * 1000
_SHARED = [(0, bytes([1, i]) * 16) for i in range(2)]  # a system prompt both sessions load
_ONLY_A = [(0, bytes([2, 0]) * 16)]
_ONLY_B = [(0, bytes([3, 0]) * 16)]


class _Engine:
    """The scheduler half's retention over a real store, its maintenance calls run at once."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.stats = StatsBox()
        self.scheme = KeyScheme(
            namespace="sess",
            model="m",
            geometry=Geometry(
                groups=(GroupSpec.full(16),), topology=Topology(tp_size=2), prefix_match_unit=16
            ),
        )
        self.sessions = SessionRetention(store, self._submit, self.stats)

    @staticmethod
    def _submit(fn: Callable[[], Any], on_done: Callable[[Future[Any]], None]) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(fn())
        on_done(fut)
        return fut

    def keys(self, blocks: list[tuple[int, bytes]]) -> list[str]:
        return [self.scheme.key(g, rank, h) for g, h in blocks for rank in (0, 1)]

    def put(self, blocks: list[tuple[int, bytes]]) -> None:
        keys = self.keys(blocks)
        assert all(s is Status.OK for s in self.store.put(keys, [_PAYLOAD] * len(keys)))

    def turn(self, session_id: str, blocks: list[tuple[int, bytes]], *, end: bool = False) -> None:
        """One turn of a session that loaded (or stored) ``blocks``: what the scheduler half calls."""
        hint = {"id": session_id, "ttl_s": 600, **({"end": True} if end else {})}
        session = self.sessions.session_of(session_id, {SESSION_PARAM: hint})
        assert session is not None
        self.sessions.retain(session, self.scheme, blocks)  # after its verified hit or its saves
        self.sessions.finished(session, self.scheme)  # request_finished

    def survivors(self, blocks: list[tuple[int, bytes]]) -> bool:
        """Flood the store with one-off entries; whether every entry of ``blocks`` is still there."""
        flood = [f"flood/{uuid.uuid4().hex}" for _ in range(256)]
        self.store.put(flood, [_PAYLOAD] * len(flood))
        return all(s is Status.OK for s in self.store.exists(self.keys(blocks)))


@pytest.fixture
def engine() -> Iterator[_Engine]:
    store = open_store(f"memory://sess-{uuid.uuid4().hex[:8]}?capacity={_CAPACITY}")
    try:
        yield _Engine(store)
    finally:
        store.close()


def test_a_shared_prefix_stays_retained_until_the_last_session_holding_it_ends(engine: _Engine) -> None:
    engine.put(_SHARED + _ONLY_A + _ONLY_B)
    engine.turn("a", _SHARED + _ONLY_A)
    engine.turn("b", _SHARED + _ONLY_B)
    assert engine.survivors(_SHARED + _ONLY_A + _ONLY_B), "retained entries did not survive a flood"
    # a's last turn loads the shared prompt again, then ends: b still holds the shared prompt.
    engine.turn("a", _SHARED + _ONLY_A, end=True)
    assert engine.survivors(_SHARED + _ONLY_B), "a's end released what b still holds"
    assert not engine.survivors(_ONLY_A), "a's own entry stayed retained after a ended"
    engine.turn("b", _SHARED, end=True)
    assert not engine.survivors(_SHARED), "the shared prompt stayed retained after both sessions ended"
    assert not engine.survivors(_ONLY_B)
    assert engine.sessions.num_held_blocks() == 0
    assert engine.stats.totals.get("session_retain_failed", 0) == 0


def test_a_session_never_releases_what_only_others_retained(engine: _Engine) -> None:
    """A one-turn session (``end`` on its first turn) that loads a prefix b retains releases nothing, and
    a later, shorter retention by another session does not cut b's short."""
    engine.put(_SHARED)
    engine.turn("b", _SHARED)
    engine.turn("one-shot", _SHARED, end=True)
    assert engine.survivors(_SHARED)
    hint = {SESSION_PARAM: {"id": "short", "ttl_s": 1e-3}}
    short = engine.sessions.session_of("short", hint)
    assert short is not None
    engine.sessions.retain(short, engine.scheme, _SHARED)
    time.sleep(0.01)  # the short retention's end passed; b's (600 s) holds
    assert engine.survivors(_SHARED), "a shorter retention cut a live session's short"
