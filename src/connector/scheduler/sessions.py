"""Session retention: a request that names a session keeps its prefix in the store while the session lives.

A client marks a request as a turn of a session in vLLM's per-request ``kv_transfer_params`` (the OpenAI
server passes the request body's ``kv_transfer_params`` through)::

    {"hybridkv_session": {"id": "chat-42", "ttl_s": 600}}          # a turn: keep the prefix 10 minutes
    {"hybridkv_session": {"id": "chat-42", "ttl_s": 600, "end": true}}  # the last turn: release it after

Contract:

- Every entry such a request stores, and every entry it loads from the store, is retained
  (``Store.retain``, ``hybridkv.store.retention``) until ``ttl_s`` seconds from then: a later turn's hit
  renews it. The store bounds what retention protects (``RETAIN_FRACTION`` of its capacity, or of a
  tenant's quota), so sessions can never pin a store full nor take another tenant's share.
- An entry stays retained while any live session of this engine retains it: the engine counts, per entry,
  the sessions that retain it and until when (a session is live until its last turn finishes or its
  retention of the entry expires). The store keeps one retention per entry, so the engine asks it for the
  latest end any live session needs: a session with a shorter ``ttl_s`` never shortens another's.
- A request with ``"end": true`` retains nothing; when it finishes, its session ends: every entry the
  session retained on this engine that no other live session of this engine retains is released (it then
  ages like any other entry); an entry others retain keeps the latest end they asked for. A session never
  releases an entry it did not retain (a shared prefix that only other clients retained, say). A turn of the
  session that finishes after its last one retains its entries again, for its own ``ttl_s``.
- What a client cannot release: an entry another live session of this engine retains. What it may: the
  store keeps one retention per entry, shared by every engine on it, so ending a session on one engine
  releases an entry that a session served by another engine also retained; that session's next hit
  retains it again. Sessions that share a prefix across engines and must keep it while one of them ends
  should not end it (their retention then lapses ``ttl_s`` after their last turn), or route a session's
  turns to one engine.
- Retain calls run on the maintenance thread, never on the scheduler's; a call the full queue refuses,
  or that the store answers with anything but ``OK`` / ``NOT_FOUND``, is counted (``session_retain_failed``).
- A bad hint (not an object; ``id`` not a non-empty string of at most ``MAX_SESSION_ID_CHARS``; ``ttl_s``
  not a number in ``(0, MAX_SESSION_TTL_S]``; ``end`` not a boolean; another key) or a hint for a store
  that cannot retain (Mooncake) is refused for that request: counted (``session_hints_refused``), logged
  once with the reason naming the key, and the request is served as if it named no session. Never an error
  to the request, never a crash.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.stats import StatsBox
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.store.base import Status, Store

__all__ = [
    "MAX_SESSION_ID_CHARS",
    "MAX_SESSION_TTL_S",
    "SESSION_PARAM",
    "RequestSession",
    "SessionHint",
    "SessionRetention",
    "parse_session_hint",
]

log = structlog.get_logger(__name__)

#: The ``kv_transfer_params`` key of a session hint.
SESSION_PARAM = "hybridkv_session"
#: The longest retention one hint may ask for (a day); longer is refused.
MAX_SESSION_TTL_S = 86400.0
MAX_SESSION_ID_CHARS = 256
_HINT_KEYS = frozenset({"id", "ttl_s", "end"})


@dataclass(frozen=True)
class SessionHint:
    """A request's session: its id, how long its entries stay retained, and whether it is the last turn."""

    session_id: str
    ttl_s: float
    end: bool = False

    def audit_detail(self) -> dict[str, Any]:
        """The detail of the request's ``start_lookup`` audit records."""
        return {"session": self.session_id, "session_ttl_s": self.ttl_s, "session_end": self.end}


def parse_session_hint(kv_transfer_params: Any) -> tuple[SessionHint | None, str | None]:
    """``(hint, None)``; ``(None, None)`` when the request names no session; ``(None, reason)`` for a hint
    that is refused (the reason names the offending key)."""
    if not isinstance(kv_transfer_params, Mapping) or SESSION_PARAM not in kv_transfer_params:
        return None, None
    raw = kv_transfer_params[SESSION_PARAM]
    if not isinstance(raw, Mapping):
        return None, f"{SESSION_PARAM} must be an object, got {type(raw).__name__}"
    unknown = sorted(str(k) for k in raw if k not in _HINT_KEYS)
    if unknown:
        return None, f"{SESSION_PARAM}: unknown key {unknown[0]!r} (expected id, ttl_s, end)"
    session_id = raw.get("id")
    if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        return None, f"{SESSION_PARAM}.id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} chars"
    ttl_s = raw.get("ttl_s")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        return None, f"{SESSION_PARAM}.ttl_s must be a number of seconds, got {ttl_s!r}"
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= MAX_SESSION_TTL_S):
        return None, f"{SESSION_PARAM}.ttl_s must be in (0, {MAX_SESSION_TTL_S:g}], got {ttl_s!r}"
    end = raw.get("end", False)
    if not isinstance(end, bool):
        return None, f"{SESSION_PARAM}.end must be true or false, got {end!r}"
    return SessionHint(session_id, float(ttl_s), end), None


@dataclass(frozen=True)
class RequestSession:
    """One request's session (``hint``): what its saves and hits retain, and whether it ends the session."""

    hint: SessionHint


#: Runs a store call on the maintenance thread: ``(fn, on_done)`` -> its future, or None when refused.
Submit = Callable[[Callable[[], Any], Callable[[concurrent.futures.Future[Any]], None]], Any]
#: A block of the key scheme: ``(group_index, block_hash)`` (one entry per rank in the store).
Block = tuple[int, bytes]
#: How often the holdings of sessions that never ended are swept once their retention expired.
_SWEEP_INTERVAL_S = 60.0


class SessionRetention:
    """The scheduler half's session retention (scheduler thread; the store calls go to ``submit``).

    It counts, per block, the live sessions that retain it (``_holders``), so a session's end releases
    only what no other live session holds (see the module docstring)."""

    def __init__(
        self, store: Store, submit: Submit, stats: StatsBox, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._submit = submit
        self._stats = stats
        #: the store's retention clock (``time.time``); tests pass their own
        self._clock = clock
        #: block -> {session id: until}: the sessions of this engine that retained it, and until when
        self._holders: dict[Block, dict[str, float]] = {}
        #: session id -> the blocks it retained (the ``_holders`` it appears in)
        self._held: dict[str, set[Block]] = {}
        self._next_sweep = 0.0

    def session_of(self, request_id: str, kv_transfer_params: Any) -> RequestSession | None:
        """The request's session, or None (no hint, or one refused: counted and logged)."""
        hint, reason = parse_session_hint(kv_transfer_params)
        if hint is not None and not self._store.supports_retention:
            hint, reason = None, "the store cannot retain entries (it evicts by its own policy)"
        if reason is not None:
            self._stats.add("session_hints_refused")
            log.warning(ConnectorLogEvent.SESSION_HINT_REFUSED, request_id=request_id, reason=reason)
        return None if hint is None else RequestSession(hint)

    def retain(self, session: RequestSession, scheme: KeyScheme, blocks: Iterable[Block]) -> None:
        """Retain every rank's entry of ``blocks`` (``(group_index, block_hash)``, stored or loaded by the
        session's request) for the session's TTL from now, or until a later end another live session
        asked for. The last turn retains nothing."""
        batch = sorted(set(blocks))
        if not batch or session.hint.end:
            return
        now = self._clock()
        self._sweep(now)
        session_id, until = session.hint.session_id, now + session.hint.ttl_s
        held = self._held.setdefault(session_id, set())
        by_until: dict[float, list[Block]] = {}
        for block in batch:
            holders = self._holders.setdefault(block, {})
            holders[session_id] = until
            held.add(block)
            # The store keeps one retention per entry: the latest any holder needs.
            by_until.setdefault(max(holders.values()), []).append(block)
        for block_until, group in by_until.items():
            self._call(scheme, group, block_until)

    def finished(self, session: RequestSession, scheme: KeyScheme) -> None:
        """The request finished: when it was the session's last turn, the session ends. Each block it
        retained (and still does) is released if no other live session holds it, else its retention is
        cut back to the latest end the others asked for."""
        if not session.hint.end:
            return
        now = self._clock()
        self._sweep(now)
        session_id = session.hint.session_id
        release: list[Block] = []
        cut_back: dict[float, list[Block]] = {}
        for block in sorted(self._held.pop(session_id, ())):
            holders = self._holders.get(block, {})
            mine = holders.pop(session_id, 0.0)
            live = {other: until for other, until in holders.items() if until > now}
            if not live:
                self._holders.pop(block, None)
                if mine > now:  # an expired retention has nothing left to release
                    release.append(block)
                continue
            latest = max(live.values())
            if latest < mine:
                cut_back.setdefault(latest, []).append(block)
        if release:
            self._call(scheme, release, 0.0)
        for until, group in cut_back.items():
            self._call(scheme, group, until)

    def num_held_blocks(self) -> int:
        """Blocks some session of this engine retains (tests, tools)."""
        return len(self._holders)

    def _sweep(self, now: float) -> None:
        """Forget retentions that expired (sessions that never sent their last turn), once a minute: the
        bookkeeping stays as large as what is retained."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_INTERVAL_S
        for block, holders in list(self._holders.items()):
            for session_id in [s for s, until in holders.items() if until <= now]:
                del holders[session_id]
                held = self._held.get(session_id)
                if held is not None:
                    held.discard(block)
                    if not held:
                        del self._held[session_id]
            if not holders:
                del self._holders[block]

    def _call(self, scheme: KeyScheme, batch: list[Block], until: float) -> None:
        ranks = [r.tp_rank for r in scheme.geometry.topology.ranks]
        keys = [scheme.key(group, rank, block_hash) for group, block_hash in batch for rank in ranks]
        store = self._store

        def done(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            statuses = fut.result() if exc is None else [Status.TRANSFER_FAILED] * len(keys)
            num_failed = sum(1 for st in statuses if st not in (Status.OK, Status.NOT_FOUND))
            num_retained = sum(1 for st in statuses if st is Status.OK)
            if until > 0:
                self._stats.add("session_retained_keys", num_retained)
            if num_failed:
                self._stats.add("session_retain_failed", num_failed)

        if self._submit(lambda: store.retain(keys, until), done) is None:
            self._stats.add("session_retain_failed", len(keys))
