"""An agentic trace replayed through real stores: the prefix tokens the store tier serves (``hybridkv bench agentic``).

Agentic traffic (vLLM AgentX traces: a median of 43 turns per session, ~142K input / 444 output tokens per
request, sub-agents in 44 % of sessions, > 96 % prefix reuse) keeps re-sending one growing prefix, and pauses
(tool calls, humans) long enough for a least-recently-used store to evict a session's prefix just before it
returns. This bench generates such a trace from a seed and replays it, request by request, through real stores
(``hybridkv.store.url.open_store``) at a capacity below the trace's working set, one store configuration
after another on the same trace, and counts the prompt tokens the store serves.

The trace (:func:`generate_trace`, pure: the same workload and seed give the same trace). Token counts are
the real ones divided by ``token_scale`` (64), the shape kept:

- ``num_sessions`` agent sessions arriving uniformly over ``session_arrival_window_s``; each belongs to one
  of ``num_tenants`` tenants (a tenant is a store namespace and a vLLM ``cache_salt``) and one of
  ``num_agent_types`` agent types, whose long system prompt (``system_prompt_tokens``) is shared by every
  session of that type and tenant.
- Turns per session: lognormal, median ``median_turns`` (43), clipped to ``[min_turns, max_turns]``. Turn 1
  sends the system prompt and a user task; every later turn re-sends the whole conversation plus the
  previous turn's model output (``model_output_median_tokens``) and a tool result
  (``tool_output_median_tokens``, lognormal): each prompt extends the session's previous prompt.
- Sub-agents: in ``subagent_session_share`` (44 %) of sessions, 1 to ``max_subagents_per_session`` forks,
  each after a random turn: a fork starts from the parent's current prefix plus a task, runs a few turns
  (lognormal, median ``subagent_median_turns``) of its own, and ends; the parent waits for it (a long tool
  call) and continues with the fork's result as its tool output.
- Clock (event-driven): each request takes ``model_median_s`` (lognormal) to answer, then the session
  pauses before its next turn: a tool call (short, frequent: median ``tool_pause_median_s``) or, with
  probability ``human_pause_probability``, a human (long, rare: median ``human_pause_median_s``). The
  requests of every session are merged in time order.
- One-off requests: ``one_off_share`` of all requests come from the ``background`` tenant, each with a
  unique prompt (median ``one_off_median_tokens``) that is never reused, spread uniformly over the trace.

Block hashes are a sha256 chain over ``block_tokens``-token blocks of token ids, with the tenant's salt mixed
into the first block (as vLLM does with ``cache_salt``); only whole blocks are hashed.

The replay (:func:`replay_trace`): the store access pattern of the connector, for one hybrid geometry (one
full-attention group with an entry per block, one Mamba group with a state at the hand-off boundaries; both
``block_tokens`` wide, TP 1), with the real key scheme (``hybridkv.lifecycle.keys.KeyScheme``, one namespace
per tenant). Per request in trace order: the connector's lookup (``hybridkv.lifecycle.lookup.LookupSearch``:
batched ``exists`` rounds; the hit is the deepest boundary where the Mamba state and every attention block
before it are stored, at most the prompt less one token), one ``get_into`` of the hit's entries into
preallocated buffers (``attention_value_bytes`` per block, ``state_value_bytes`` per state), and one ``put``
of the save the connector makes (``hybridkv.lifecycle.save.plan_save``): every whole prompt block past the hit
and the Mamba state at the prompt's last whole block (vLLM hands the state off there). The engine's own
prefix cache is taken as empty: the store is the only source of hit tokens.

What is counted, exactly:

- per request: prompt tokens, hit tokens (the loaded boundary; 0 if a load failed), bytes read and bytes
  written. Bytes written are the entries of the put that the store did not hold just before it: the bench
  asks ``exists`` on the put's keys right before the put (bookkeeping, not the connector's traffic; the
  entries it finds are touched, as the put would). Since the bench never removes keys, a tenant's
  **evicted bytes** at any moment are its bytes written so far less the bytes of its keys still stored.
  (One case escapes both counts alike: an entry present before a put, evicted by an earlier value of the
  same put and written again by it.)
- presence is read with one ``iter_keys`` every ``sample_every`` requests and at the end (default every 8
  on the memory store, where a listing copies the key table, and every 64 on the file store, where it reads
  every file's header: listing after every request would cost more than the replay itself). Since the bench
  never removes keys and only puts evict, a tenant's evicted bytes (written less still stored) are exact at
  every sample.
- **Bytes evicted by another tenant's puts while it was over its quota**, from what the store did: around
  every put of the background tenant (the one with a quota: ``background_quota_fraction`` of capacity; in
  the configurations without quotas the quota it would have) the bench lists the store's keys just before
  and just after the put. The other tenants' keys listed before and gone after were evicted by that put
  (nothing else runs meanwhile, and only puts evict). What the background held is counted as the store
  counts it: framed bytes (header, key and payload, ``FIXED_HEADER_SIZE + len(key) + payload``), before and
  after the put. A put after or before which it held more than its quota is an *over-quota put*; the other
  tenants' bytes it evicted are ``tenant_to_bytes_evicted_over_quota`` (payload bytes, per tenant), the ones
  the background's other puts evicted ``tenant_to_bytes_evicted_within_quota`` (capacity eviction: the store
  was full, and a tenant within its quota competes for capacity like any other). A store that enforces the
  quota keeps the first at 0; plain LRU does not. It costs two listings per background put (a tenth of the
  requests).

Configurations (:data:`CONFIGURATIONS`): ``lru`` (``memory://`` as it is: one LRU over everything),
``lru+quotas`` (the same with ``quotas=background:SIZE``), ``file-lru`` (``file://``: LRU by file mtime,
touched at most once a second, so over a replay of seconds it is close to first-in first-out) and
``file-lru+quotas`` (its directory's quota file), ``lru+sessions`` / ``file-lru+sessions`` (sessions retain
their prefix: ``Store.retain``). A configuration the store refuses (``StoreError``, e.g.
before quotas existed) is reported unavailable with the error. Capacities count framed bytes (a ~100-byte
header per value); the working set is the payload bytes of every distinct entry the trace saves.

Rounds: round ``r`` generates the trace of seed ``seed + r`` and runs every configuration on it, in an order
rotated by ``r``, each on a fresh empty store; figures are medians over rounds with min/max, and differences
against the baseline (the first configuration: ``lru``) are taken per round (same trace) first.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import heapq
import os
import platform
import shutil
import statistics
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
from hybridkv.bench.report import pyplot_or_none, save_figure, target_row
from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.keys import KEY_VERSION, KeyScheme
from hybridkv.lifecycle.kinds import GroupSpec
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.lifecycle.save import plan_save
from hybridkv.store.base import Destination, Status, Store, StoreError, Value
from hybridkv.store.frame import FIXED_HEADER_SIZE
from hybridkv.store.memory import drop_memory_store
from hybridkv.store.url import open_store

__all__ = [
    "BACKGROUND_TENANT",
    "CONFIGURATIONS",
    "STORE_CHOICES",
    "TABLE_COLUMNS",
    "TARGET_POINTS_OVER_LRU",
    "AgenticTrace",
    "AgenticWorkload",
    "ReplayResult",
    "RequestKind",
    "StoreConfiguration",
    "TraceChain",
    "TraceRequest",
    "agentic_tenants",
    "bench_geometry",
    "block_hash_chain",
    "configurations_for",
    "describe_shape",
    "evicted_by_background_table_rows",
    "evicted_table_rows",
    "generate_trace",
    "opened_store",
    "plot_report",
    "replay_trace",
    "run_agentic_bench",
    "tenant_salt",
]

#: The tenant (namespace) of the one-off requests.
BACKGROUND_TENANT = "background"
#: The issue's target: at least this many percentage points more prompt tokens served than plain LRU.
TARGET_POINTS_OVER_LRU = 15.0
#: Token ids are drawn from this vocabulary.
_VOCABULARY = 150_000
#: The hash chain's parent of the first block (vLLM: ``NONE_HASH``, from a seed).
_ROOT_HASH = hashlib.sha256(b"hybridkv-bench-agentic").digest()


class RequestKind(enum.StrEnum):
    """Which kind of chain a request belongs to."""

    TURN = "turn"  # a turn of an agent session
    SUBAGENT = "subagent"  # a turn of a sub-agent forked from a session
    ONE_OFF = "one_off"  # a background request with a unique prompt


@dataclass(frozen=True, kw_only=True)
class AgenticWorkload:
    """The knobs of the trace (see the module docstring for the shape). Token counts are real ones divided
    by ``token_scale``; the defaults replay in seconds per configuration on the memory store."""

    num_sessions: int = 24
    median_turns: float = 43.0
    turns_sigma: float = 0.5
    min_turns: int = 2
    max_turns: int = 150
    #: Real tokens per trace token (documentation only: every count below is already scaled).
    token_scale: int = 64
    block_tokens: int = 32
    num_tenants: int = 3
    num_agent_types: int = 3
    system_prompt_tokens: int = 256  # 16K real: tool definitions and instructions
    user_task_tokens: int = 24
    model_output_median_tokens: float = 7.0  # 444 real
    tool_output_median_tokens: float = 32.0  # 2K real (file reads, command output), lognormal
    tool_output_sigma: float = 1.0
    subagent_session_share: float = 0.44
    max_subagents_per_session: int = 3
    subagent_median_turns: float = 6.0
    subagent_task_tokens: int = 16
    one_off_share: float = 0.1
    one_off_median_tokens: float = 2048.0  # 131K real
    session_arrival_window_s: float = 1800.0
    model_median_s: float = 8.0
    tool_pause_median_s: float = 2.0
    human_pause_probability: float = 0.07
    human_pause_median_s: float = 300.0

    def __post_init__(self) -> None:
        assert self.num_sessions >= 1 and self.num_tenants >= 1 and self.num_agent_types >= 1, self
        assert 1 <= self.min_turns <= self.max_turns and self.median_turns > 0, self
        assert self.block_tokens >= 1 and self.system_prompt_tokens >= 1 and self.user_task_tokens >= 1, self
        assert 0 <= self.subagent_session_share <= 1 and 0 <= self.one_off_share < 1, self
        assert 0 <= self.human_pause_probability <= 1 and self.max_subagents_per_session >= 1, self


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: its prompt is the first ``num_prompt_tokens`` tokens of its chain."""

    index: int  # position in trace (time) order
    time_s: float
    chain: int  # index into ``AgenticTrace.chains``
    kind: RequestKind
    tenant: str
    num_prompt_tokens: int
    #: the hashes of the prompt's whole blocks (``block_hash_chain`` of the prompt and the tenant's salt)
    block_hashes: tuple[bytes, ...] = field(repr=False)


@dataclass(frozen=True)
class TraceChain:
    """A session, a sub-agent or a one-off request: every request of it sends a prefix of ``tokens``."""

    chain: int
    kind: RequestKind
    tenant: str
    #: the session a sub-agent was forked from, and the tokens of the parent it started with
    parent: int | None
    num_parent_tokens: int
    tokens: tuple[int, ...] = field(repr=False)


@dataclass(frozen=True)
class AgenticTrace:
    """A generated trace: requests in time order, the chains they belong to, and the pauses drawn."""

    workload: AgenticWorkload
    seed: int
    requests: tuple[TraceRequest, ...]
    chains: tuple[TraceChain, ...]
    tool_pauses_s: tuple[float, ...]
    human_pauses_s: tuple[float, ...]

    def prompt_tokens(self, request: TraceRequest) -> tuple[int, ...]:
        """The token ids of ``request``'s prompt."""
        return self.chains[request.chain].tokens[: request.num_prompt_tokens]

    @property
    def tenants(self) -> tuple[str, ...]:
        """Every tenant with requests: the agentic ones (sorted), then the background one."""
        agentic = sorted({r.tenant for r in self.requests if r.tenant != BACKGROUND_TENANT})
        has_background = any(r.tenant == BACKGROUND_TENANT for r in self.requests)
        return (*agentic, *((BACKGROUND_TENANT,) if has_background else ()))

    def entry_counts(self) -> tuple[int, int]:
        """Distinct (attention blocks, Mamba states) an unbounded store holds after the replay: every whole
        prompt block, and a state at every prompt's last whole block, per tenant."""
        blocks: set[tuple[str, bytes]] = set()
        states: set[tuple[str, bytes]] = set()
        for request in self.requests:
            blocks.update((request.tenant, block_hash) for block_hash in request.block_hashes)
            if request.block_hashes:
                states.add((request.tenant, request.block_hashes[-1]))
        return len(blocks), len(states)

    def working_set_bytes(self, attention_value_bytes: int, state_value_bytes: int) -> int:
        """Payload bytes of every distinct entry the replay saves (what an unbounded store ends up holding)."""
        num_blocks, num_states = self.entry_counts()
        return num_blocks * attention_value_bytes + num_states * state_value_bytes

    def ideal_hit_tokens(self) -> list[int]:
        """Per request, the hit tokens of an unbounded store: the deepest whole-block boundary, at most the
        prompt less one token, at which an earlier request of the tenant left a Mamba state (whose save
        also stored every attention block before it)."""
        block_tokens = self.workload.block_tokens
        states: set[tuple[str, bytes]] = set()
        hits: list[int] = []
        for request in self.requests:
            cap = min(request.num_prompt_tokens - 1, len(request.block_hashes) * block_tokens)
            hit = 0
            for num_blocks in range(cap // block_tokens, 0, -1):
                if (request.tenant, request.block_hashes[num_blocks - 1]) in states:
                    hit = num_blocks * block_tokens
                    break
            hits.append(hit)
            if request.block_hashes:
                states.add((request.tenant, request.block_hashes[-1]))
        return hits

    def shape(self) -> dict[str, Any]:
        """The trace's shape, as the report prints it (trace tokens; ``*_real`` multiplied back)."""
        w = self.workload
        sessions = [c for c in self.chains if c.kind is RequestKind.TURN]
        subagents = [c for c in self.chains if c.kind is RequestKind.SUBAGENT]
        chain_to_num_requests: dict[int, int] = {}
        for request in self.requests:
            chain_to_num_requests[request.chain] = chain_to_num_requests.get(request.chain, 0) + 1
        turns = sorted(chain_to_num_requests.get(c.chain, 0) for c in sessions)
        subagent_turns = sorted(chain_to_num_requests.get(c.chain, 0) for c in subagents)
        prompts = [r.num_prompt_tokens for r in self.requests]
        ideal = self.ideal_hit_tokens()
        agentic = [i for i, r in enumerate(self.requests) if r.kind is not RequestKind.ONE_OFF]
        num_blocks, num_states = self.entry_counts()
        mean_prompt = statistics.fmean(prompts) if prompts else 0.0
        return {
            "seed": self.seed,
            "token_scale": w.token_scale,
            "block_tokens": w.block_tokens,
            "num_sessions": len(sessions),
            "turns_per_session_median": _median(turns),
            "turns_per_session_p10_p90": [_quantile(turns, 0.1), _quantile(turns, 0.9)],
            "subagent_session_share": len({c.parent for c in subagents}) / max(1, len(sessions)),
            "num_subagents": len(subagents),
            "subagent_turns_median": _median(subagent_turns),
            "num_requests": len(self.requests),
            "num_requests_by_kind": {
                kind.value: sum(r.kind is kind for r in self.requests) for kind in RequestKind
            },
            "one_off_share": (len(self.requests) - len(agentic)) / max(1, len(self.requests)),
            "prompt_tokens_median": _median(prompts),
            "prompt_tokens_mean": mean_prompt,
            "prompt_tokens_mean_real": mean_prompt * w.token_scale,
            "model_output_tokens_median_real": w.model_output_median_tokens * w.token_scale,
            "tenants": list(self.tenants),
            "num_agent_types": w.num_agent_types,
            "system_prompt_tokens": w.system_prompt_tokens,
            "num_tool_pauses": len(self.tool_pauses_s),
            "tool_pause_median_s": _median(self.tool_pauses_s),
            "num_human_pauses": len(self.human_pauses_s),
            "human_pause_median_s": _median(self.human_pauses_s),
            "span_s": self.requests[-1].time_s if self.requests else 0.0,
            "prefix_reuse_agentic": sum(ideal[i] for i in agentic)
            / max(1, sum(self.requests[i].num_prompt_tokens for i in agentic)),
            "ideal_hit_fraction": sum(ideal) / max(1, sum(prompts)),
            "num_distinct_blocks": num_blocks,
            "num_distinct_states": num_states,
        }


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ascending ``sorted_values`` (0 when empty)."""
    if not sorted_values:
        return 0.0
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


def tenant_salt(tenant: str) -> bytes:
    """The ``cache_salt`` of ``tenant``'s requests (mixed into each prompt's first block hash)."""
    return f"salt:{tenant}".encode()


def block_hash_chain(
    tokens: Sequence[int], block_tokens: int, salt: bytes, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The hashes of every whole block of ``tokens``: ``h_i = sha256(h_{i-1} || block_i as uint32 || salt if
    i == 0)``, ``h_{-1}`` a fixed root. ``known``: the hashes of a prefix of them already computed (kept)."""
    hashes = list(known)
    pack = struct.Struct(f"<{block_tokens}I").pack
    parent = hashes[-1] if hashes else _ROOT_HASH
    for index in range(len(hashes), len(tokens) // block_tokens):
        block = pack(*tokens[index * block_tokens : (index + 1) * block_tokens])
        parent = hashlib.sha256(parent + block + (salt if index == 0 else b"")).digest()
        hashes.append(parent)
    return hashes


def agentic_tenants(workload: AgenticWorkload) -> tuple[str, ...]:
    """The namespaces of the agent sessions' tenants: ``tenant-a``, ``tenant-b``, ..."""
    return tuple(f"tenant-{_letters(index)}" for index in range(workload.num_tenants))


def _letters(index: int) -> str:
    """0 -> a, 25 -> z, 26 -> ba, ... (a name segment for any count)."""
    text = ""
    while True:
        index, digit = divmod(index, 26)
        text = chr(ord("a") + digit) + text
        if index == 0:
            return text


@dataclass
class _Chain:
    """A chain while the trace is generated: its tokens and whole-block hashes so far."""

    chain: int
    kind: RequestKind
    tenant: str
    parent: int | None
    num_parent_tokens: int
    tokens: list[int]
    hashes: list[bytes]
    num_turns: int
    #: (sessions) the turns (0-based) after whose request a sub-agent is forked
    fork_after_turns: frozenset[int] = frozenset()
    num_sent: int = 0


class _TraceBuilder:
    """Draws one trace; every draw comes from one generator in a fixed order (events in time order)."""

    def __init__(self, workload: AgenticWorkload, seed: int) -> None:
        self.workload = workload
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.chains: list[_Chain] = []
        #: (time, sequence number, chain): the next request of each live chain
        self.events: list[tuple[float, int, int]] = []
        self.num_events = 0
        #: (time, sequence number, chain, prompt tokens, block hashes)
        self.sent: list[tuple[float, int, int, int, tuple[bytes, ...]]] = []
        self.tool_pauses_s: list[float] = []
        self.human_pauses_s: list[float] = []

    def tokens(self, count: int) -> list[int]:
        return cast("list[int]", self.rng.integers(0, _VOCABULARY, count).tolist())

    def lognormal_count(self, median: float, sigma: float, low: int, high: int) -> int:
        return int(min(high, max(low, round(float(self.rng.lognormal(np.log(median), sigma))))))

    def lognormal_s(self, median: float, sigma: float) -> float:
        return float(self.rng.lognormal(np.log(median), sigma))

    def new_chain(
        self,
        kind: RequestKind,
        tenant: str,
        tokens: list[int],
        num_turns: int,
        *,
        parent: _Chain | None = None,
        fork_after_turns: frozenset[int] = frozenset(),
    ) -> _Chain:
        hashes = block_hash_chain(
            tokens, self.workload.block_tokens, tenant_salt(tenant), parent.hashes if parent else ()
        )
        chain = _Chain(
            chain=len(self.chains),
            kind=kind,
            tenant=tenant,
            parent=None if parent is None else parent.chain,
            num_parent_tokens=0 if parent is None else len(parent.tokens),
            tokens=tokens,
            hashes=hashes,
            num_turns=num_turns,
            fork_after_turns=fork_after_turns,
        )
        self.chains.append(chain)
        return chain

    def extend(self, chain: _Chain, tokens: list[int]) -> None:
        chain.tokens.extend(tokens)
        chain.hashes = block_hash_chain(
            chain.tokens, self.workload.block_tokens, tenant_salt(chain.tenant), chain.hashes
        )

    def schedule(self, time_s: float, chain: _Chain) -> None:
        heapq.heappush(self.events, (time_s, self.num_events, chain.chain))
        self.num_events += 1

    def send(self, time_s: float, chain: _Chain) -> None:
        num_blocks = len(chain.tokens) // self.workload.block_tokens
        self.sent.append(
            (time_s, len(self.sent), chain.chain, len(chain.tokens), tuple(chain.hashes[:num_blocks]))
        )
        chain.num_sent += 1

    def model_output(self) -> list[int]:
        w = self.workload
        return self.tokens(self.lognormal_count(w.model_output_median_tokens, 0.5, 1, 64 * w.block_tokens))

    def tool_output(self) -> list[int]:
        w = self.workload
        high = 16 * max(w.block_tokens, round(w.tool_output_median_tokens))
        return self.tokens(self.lognormal_count(w.tool_output_median_tokens, w.tool_output_sigma, 1, high))

    def pause_s(self, *, humans: bool) -> float:
        w = self.workload
        if humans and self.rng.random() < w.human_pause_probability:
            pause = self.lognormal_s(w.human_pause_median_s, 0.8)
            self.human_pauses_s.append(pause)
        else:
            pause = self.lognormal_s(w.tool_pause_median_s, 0.8)
            self.tool_pauses_s.append(pause)
        return pause

    def start_sessions(self) -> None:
        w = self.workload
        tenants = agentic_tenants(w)
        system_prompts = [self.tokens(w.system_prompt_tokens) for _ in range(w.num_agent_types)]
        for index in range(w.num_sessions):
            tenant = tenants[index % len(tenants)]
            agent_type = int(self.rng.integers(w.num_agent_types))
            num_turns = self.lognormal_count(w.median_turns, w.turns_sigma, w.min_turns, w.max_turns)
            fork_after_turns: frozenset[int] = frozenset()
            if self.rng.random() < w.subagent_session_share and num_turns >= 2:
                num_forks = min(int(self.rng.integers(1, w.max_subagents_per_session + 1)), num_turns - 1)
                # after turn k the session continues with turn k + 1: k in [0, num_turns - 2]
                fork_after_turns = frozenset(
                    int(k) for k in self.rng.choice(num_turns - 1, num_forks, replace=False)
                )
            tokens = [*system_prompts[agent_type], *self.tokens(w.user_task_tokens)]
            chain = self.new_chain(
                RequestKind.TURN, tenant, tokens, num_turns, fork_after_turns=fork_after_turns
            )
            self.schedule(float(self.rng.uniform(0.0, w.session_arrival_window_s)), chain)

    def run_events(self) -> None:
        """Send every chain's requests in time order (a parent waits while its sub-agent runs)."""
        w = self.workload
        while self.events:
            time_s, _, chain_index = heapq.heappop(self.events)
            chain = self.chains[chain_index]
            self.send(time_s, chain)
            done_s = time_s + self.lognormal_s(w.model_median_s, 0.4)
            self.extend(chain, self.model_output())
            if chain.num_sent == chain.num_turns:
                if chain.parent is not None:  # a sub-agent's answer is its parent's tool result
                    parent = self.chains[chain.parent]
                    self.extend(parent, self.tool_output())
                    self.schedule(done_s, parent)
                continue
            if chain.num_sent - 1 in chain.fork_after_turns:
                num_turns = self.lognormal_count(w.subagent_median_turns, 0.5, 1, w.max_turns)
                fork = self.new_chain(
                    RequestKind.SUBAGENT,
                    chain.tenant,
                    [*chain.tokens, *self.tokens(w.subagent_task_tokens)],
                    num_turns,
                    parent=chain,
                )
                self.schedule(done_s, fork)
                continue
            self.extend(chain, self.tool_output())
            self.schedule(done_s + self.pause_s(humans=chain.kind is RequestKind.TURN), chain)

    def add_one_offs(self) -> None:
        """``one_off_share`` of all requests: background prompts that no other request shares."""
        w = self.workload
        num_agentic = len(self.sent)
        num_one_offs = round(w.one_off_share * num_agentic / (1.0 - w.one_off_share))
        span_s = max((sent[0] for sent in self.sent), default=0.0)
        high = 8 * round(w.one_off_median_tokens)
        for _ in range(num_one_offs):
            time_s = float(self.rng.uniform(0.0, span_s))
            num_tokens = self.lognormal_count(w.one_off_median_tokens, 0.5, w.block_tokens + 1, high)
            chain = self.new_chain(RequestKind.ONE_OFF, BACKGROUND_TENANT, self.tokens(num_tokens), 1)
            self.send(time_s, chain)

    def trace(self) -> AgenticTrace:
        chains = tuple(
            TraceChain(c.chain, c.kind, c.tenant, c.parent, c.num_parent_tokens, tuple(c.tokens))
            for c in self.chains
        )
        ordered = sorted(self.sent, key=lambda sent: (sent[0], sent[1]))
        requests = tuple(
            TraceRequest(index, time_s, chain, chains[chain].kind, chains[chain].tenant, num_tokens, hashes)
            for index, (time_s, _, chain, num_tokens, hashes) in enumerate(ordered)
        )
        return AgenticTrace(
            self.workload, self.seed, requests, chains, tuple(self.tool_pauses_s), tuple(self.human_pauses_s)
        )


def generate_trace(workload: AgenticWorkload, seed: int) -> AgenticTrace:
    """The trace of ``workload`` for ``seed`` (pure: the same arguments give the same trace)."""
    builder = _TraceBuilder(workload, seed)
    builder.start_sessions()
    builder.run_events()
    builder.add_one_offs()
    return builder.trace()


# -- the replay ---------------------------------------------------------------------------------------------------

#: The store groups of the bench geometry.
ATTENTION_GROUP = 0
STATE_GROUP = 1
DEFAULT_ATTENTION_VALUE_BYTES = 16 << 10
DEFAULT_STATE_VALUE_BYTES = 32 << 10
#: ``iter_keys`` once every this many requests, by store scheme (see the module docstring).
DEFAULT_SAMPLE_EVERY = {"memory": 8, "file": 64}
#: Windows of the hit fraction over the trace (the plot, the report's ``windows``).
NUM_WINDOWS = 40


def bench_geometry(block_tokens: int) -> Geometry:
    """Full attention with an entry per block and a Mamba state at hand-off boundaries, both
    ``block_tokens`` wide, TP 1."""
    return Geometry(groups=(GroupSpec.full(block_tokens), GroupSpec.mamba(block_tokens)))


@dataclass(frozen=True)
class ReplayResult:
    """What one replay of a trace through one store counted (see the module docstring)."""

    configuration: str
    seed: int
    url: str
    capacity_bytes: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    agentic_prompt_tokens: int
    agentic_hit_tokens: int
    bytes_read: int
    bytes_written: int
    tenant_to_bytes_written: dict[str, int]
    tenant_to_bytes_evicted: dict[str, int]
    #: per tenant, payload bytes evicted by the background's puts that ended or began with it over its quota
    tenant_to_bytes_evicted_over_quota: dict[str, int]
    #: per tenant, payload bytes evicted by the background's other puts (capacity eviction)
    tenant_to_bytes_evicted_within_quota: dict[str, int]
    #: the background's quota (the store's, or the one it would have); framed bytes
    reference_quota_bytes: int
    #: the most framed bytes the background held right after one of its puts
    quota_tenant_peak_bytes: int
    #: background puts that ended or began with it over its quota
    num_over_quota_puts: int
    num_samples: int
    num_load_failures: int
    num_put_failures: int
    num_exists_calls: int
    seconds: float
    #: hit tokens / prompt tokens per window of requests, in trace order
    window_hit_fractions: list[float]
    #: ``stats().extra["tenants"]`` at the end (stores with quotas)
    store_tenants: dict[str, Any]

    @property
    def hit_fraction(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def agentic_hit_fraction(self) -> float:
        return self.agentic_hit_tokens / max(1, self.agentic_prompt_tokens)

    @property
    def agentic_bytes_evicted_over_quota(self) -> int:
        """The agentic tenants' bytes evicted by the background's puts while it was over its quota."""
        return sum(v for t, v in self.tenant_to_bytes_evicted_over_quota.items() if t != BACKGROUND_TENANT)


def _present_bytes(store: Store, group_to_value_bytes: Sequence[int]) -> dict[str, int]:
    """Per namespace, the payload bytes of the block keys ``store`` holds now (``hkv1/NS/FP/gG/...``)."""
    namespace_to_bytes: dict[str, int] = {}
    for key in store.iter_keys(f"{KEY_VERSION}/"):
        parts = key.split("/", 4)
        size = group_to_value_bytes[int(parts[3][1:])]
        namespace_to_bytes[parts[1]] = namespace_to_bytes.get(parts[1], 0) + size
    return namespace_to_bytes


def _framed_holdings(store: Store, group_to_value_bytes: Sequence[int]) -> dict[str, tuple[str, int, int]]:
    """Every block key ``store`` holds now: key -> (namespace, framed bytes as the store counts them, payload
    bytes)."""
    holdings: dict[str, tuple[str, int, int]] = {}
    for key in store.iter_keys(f"{KEY_VERSION}/"):
        parts = key.split("/", 4)
        payload = group_to_value_bytes[int(parts[3][1:])]
        holdings[key] = (parts[1], FIXED_HEADER_SIZE + len(key.encode()) + payload, payload)
    return holdings


def _windows(hits: Sequence[int], prompts: Sequence[int], num_windows: int) -> list[float]:
    """Hit tokens over prompt tokens in ``num_windows`` consecutive windows of requests."""
    size = max(1, -(-len(prompts) // max(1, num_windows)))
    return [
        sum(hits[start : start + size]) / max(1, sum(prompts[start : start + size]))
        for start in range(0, len(prompts), size)
    ]


class _Replay:
    """The state of one replay: the store, the buffers, and what has been counted so far."""

    def __init__(
        self,
        trace: AgenticTrace,
        store: Store,
        *,
        reference_quota_bytes: int,
        attention_value_bytes: int,
        state_value_bytes: int,
    ) -> None:
        self.store = store
        self.block_tokens = trace.workload.block_tokens
        self.reference_quota_bytes = reference_quota_bytes
        self.group_to_value_bytes = (attention_value_bytes, state_value_bytes)
        geometry = bench_geometry(self.block_tokens)
        self.tenants = trace.tenants
        self.tenant_to_scheme = {
            tenant: KeyScheme(namespace=tenant, model="hybridkv-bench-agentic", geometry=geometry)
            for tenant in self.tenants
        }
        max_blocks = max((len(r.block_hashes) for r in trace.requests), default=0)
        # Destinations: a row per block a load may fetch, and one state (a hit loads one state).
        self.attention_rows = np.zeros((max(1, max_blocks), attention_value_bytes), dtype=np.uint8)
        self.state_row = np.zeros(state_value_bytes, dtype=np.uint8)
        self.group_to_value: tuple[Value, Value] = (
            cast(Value, np.full(attention_value_bytes, 0xA5, dtype=np.uint8)),
            cast(Value, np.full(state_value_bytes, 0x5A, dtype=np.uint8)),
        )
        self.tenant_to_written = dict.fromkeys(self.tenants, 0)
        self.tenant_to_evicted = dict.fromkeys(self.tenants, 0)
        #: the tenants whose puts are watched for evicting others (see the module docstring), with the quota
        self.tenant_to_quota = {BACKGROUND_TENANT: reference_quota_bytes} if reference_quota_bytes > 0 else {}
        self.tenant_to_evicted_over_quota = dict.fromkeys(self.tenants, 0)
        self.tenant_to_evicted_within_quota = dict.fromkeys(self.tenants, 0)
        self.quota_tenant_peak_bytes = 0
        self.num_over_quota_puts = 0
        self.num_samples = 0
        self.num_load_failures = 0
        self.num_put_failures = 0
        self.num_exists_calls = 0
        self.bytes_read = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """The lookup's existence check: one batched ``exists``."""
        self.num_exists_calls += 1
        return [status is Status.OK for status in self.store.exists(keys)]

    def lookup_and_load(self, request: TraceRequest) -> int:
        """The connector's lookup of ``request`` and the load of its hit; the hit tokens (0 if the load
        failed: vLLM then recomputes the request from 0)."""
        scheme = self.tenant_to_scheme[request.tenant]
        result = LookupSearch(scheme, request.block_hashes, request.num_prompt_tokens, 0).run(self.exists)
        if result.plan is None or not result.plan.loads:
            return 0
        entries = result.plan.entries
        destinations: list[Destination] = []
        num_attention = 0
        for entry, _key in entries:
            if entry.group_index == ATTENTION_GROUP:
                destinations.append(cast(Destination, self.attention_rows[num_attention]))
                num_attention += 1
            else:
                destinations.append(cast(Destination, self.state_row))
        statuses = self.store.get_into([key for _, key in entries], destinations)
        if not all(status is Status.OK for status in statuses):
            self.num_load_failures += 1
            return 0
        self.bytes_read += sum(self.group_to_value_bytes[entry.group_index] for entry, _ in entries)
        return result.boundary

    def save(self, request: TraceRequest, hit: int) -> None:
        """The connector's save of ``request``: every whole prompt block past ``hit``, and the Mamba state at
        the last whole block (unless the hit reached it)."""
        block_tokens = self.block_tokens
        num_blocks = len(request.block_hashes)
        plan = plan_save(
            self.tenant_to_scheme[request.tenant],
            request.block_hashes,
            {
                ATTENTION_GROUP: [(i + 1) * block_tokens for i in range(hit // block_tokens, num_blocks)],
                STATE_GROUP: [num_blocks * block_tokens] if num_blocks * block_tokens > hit else [],
            },
        )
        if not plan.entries:
            return
        keys = [key for _, key in plan.entries]
        quota = self.tenant_to_quota.get(request.tenant)
        holdings = None if quota is None else _framed_holdings(self.store, self.group_to_value_bytes)
        before = self.store.exists(keys)  # bookkeeping: which of them the put really writes
        statuses = self.store.put(keys, [self.group_to_value[entry.group_index] for entry, _ in plan.entries])
        if holdings is not None and quota is not None:
            self.account_evictions_by(request.tenant, quota, holdings)
        for (entry, _key), was, status in zip(plan.entries, before, statuses, strict=True):
            if status is not Status.OK:
                self.num_put_failures += 1
            elif was is Status.NOT_FOUND:
                self.tenant_to_written[request.tenant] += self.group_to_value_bytes[entry.group_index]

    def account_evictions_by(
        self, tenant: str, quota: int, holdings: Mapping[str, tuple[str, int, int]]
    ) -> None:
        """Count what the put of ``tenant`` just made evicted of the other tenants: the keys of ``holdings``
        (what the store held before it) that are gone now; over its quota if it held more than ``quota``
        framed bytes before or after the put."""
        after = _framed_holdings(self.store, self.group_to_value_bytes)
        held_before = sum(framed for owner, framed, _ in holdings.values() if owner == tenant)
        held_after = sum(framed for owner, framed, _ in after.values() if owner == tenant)
        self.quota_tenant_peak_bytes = max(self.quota_tenant_peak_bytes, held_after)
        over = max(held_before, held_after) > quota
        self.num_over_quota_puts += over
        counts = self.tenant_to_evicted_over_quota if over else self.tenant_to_evicted_within_quota
        for key, (owner, _framed, payload) in holdings.items():
            if owner != tenant and key not in after:
                counts[owner] = counts.get(owner, 0) + payload

    def retain_prompt(self, request: TraceRequest, *, release: bool) -> None:
        """The session's retention of ``request``'s prompt: every whole block and the state at its end, for
        ``SESSION_TTL_S`` (``release``: the session is over, its entries become ordinary ones)."""
        scheme = self.tenant_to_scheme[request.tenant]
        hashes = request.block_hashes
        if not hashes:
            return
        keys = [scheme.key(ATTENTION_GROUP, 0, block_hash) for block_hash in hashes]
        keys.append(scheme.key(STATE_GROUP, 0, hashes[-1]))
        self.store.retain(keys, 0.0 if release else time.time() + SESSION_TTL_S)

    def sample(self) -> None:
        """Read what each tenant still holds: its evicted bytes are what it wrote less that."""
        present = _present_bytes(self.store, self.group_to_value_bytes)
        for tenant in self.tenants:
            self.tenant_to_evicted[tenant] = self.tenant_to_written[tenant] - present.get(tenant, 0)
        self.num_samples += 1


def replay_trace(
    trace: AgenticTrace,
    store: Store,
    *,
    configuration: str = "",
    capacity_bytes: int = 0,
    reference_quota_bytes: int = 0,
    attention_value_bytes: int = DEFAULT_ATTENTION_VALUE_BYTES,
    state_value_bytes: int = DEFAULT_STATE_VALUE_BYTES,
    sample_every: int = 1,
    sessions: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through ``store`` (empty, used by nothing else meanwhile) as the connector would: per
    request a lookup, a load of the hit and a save of the rest (see the module docstring).

    ``reference_quota_bytes``: the background tenant's quota (for a store without quotas: the quota it is
    compared against), framed bytes, for the bytes its puts evict of the others while it is over it (0: not
    watched); ``capacity_bytes`` is only reported.
    ``sample_every``: requests between two presence samples (``iter_keys``), at least 1. ``sessions``: each
    agentic request retains its prompt after its save, a chain's last request releases it.
    """
    assert sample_every >= 1, sample_every
    replay = _Replay(
        trace,
        store,
        reference_quota_bytes=reference_quota_bytes,
        attention_value_bytes=attention_value_bytes,
        state_value_bytes=state_value_bytes,
    )
    hits: list[int] = []
    prompts: list[int] = []
    start = time.perf_counter()
    chain_to_last = {request.chain: request.index for request in trace.requests}
    for position, request in enumerate(trace.requests, start=1):
        hit = replay.lookup_and_load(request)
        replay.save(request, hit)
        if sessions and request.kind is not RequestKind.ONE_OFF:
            replay.retain_prompt(request, release=chain_to_last[request.chain] == request.index)
        hits.append(hit)
        prompts.append(request.num_prompt_tokens)
        if position % sample_every == 0:
            replay.sample()
    if len(trace.requests) % sample_every:
        replay.sample()
    seconds = time.perf_counter() - start
    agentic = [i for i, r in enumerate(trace.requests) if r.tenant != BACKGROUND_TENANT]
    tenant_stats = store.stats().extra.get("tenants", {})
    return ReplayResult(
        configuration=configuration,
        seed=trace.seed,
        url=store.url,
        capacity_bytes=capacity_bytes,
        num_requests=len(trace.requests),
        prompt_tokens=sum(prompts),
        hit_tokens=sum(hits),
        agentic_prompt_tokens=sum(prompts[i] for i in agentic),
        agentic_hit_tokens=sum(hits[i] for i in agentic),
        bytes_read=replay.bytes_read,
        bytes_written=sum(replay.tenant_to_written.values()),
        tenant_to_bytes_written=replay.tenant_to_written,
        tenant_to_bytes_evicted=replay.tenant_to_evicted,
        tenant_to_bytes_evicted_over_quota=replay.tenant_to_evicted_over_quota,
        tenant_to_bytes_evicted_within_quota=replay.tenant_to_evicted_within_quota,
        reference_quota_bytes=reference_quota_bytes,
        quota_tenant_peak_bytes=replay.quota_tenant_peak_bytes,
        num_over_quota_puts=replay.num_over_quota_puts,
        num_samples=replay.num_samples,
        num_load_failures=replay.num_load_failures,
        num_put_failures=replay.num_put_failures,
        num_exists_calls=replay.num_exists_calls,
        seconds=seconds,
        window_hit_fractions=_windows(hits, prompts, NUM_WINDOWS),
        store_tenants=dict(tenant_stats) if isinstance(tenant_stats, dict) else {},
    )


# -- configurations and the bench ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreConfiguration:
    """One store setup the bench replays the trace through."""

    name: str
    scheme: str  # "memory" or "file"
    #: whether the background tenant gets a quota (``background_quota_fraction`` of capacity)
    background_quota: bool
    #: more query parameters of the store URL (``name=value&...``), e.g. another eviction policy
    url_params: str = ""
    #: whether sessions retain their prefix (``Store.retain``): each agentic request retains its prompt's
    #: entries for ``SESSION_TTL_S`` after its save, and a chain's last request releases them
    sessions: bool = False


CONFIGURATIONS = (
    StoreConfiguration("lru", "memory", background_quota=False),
    StoreConfiguration("lru+quotas", "memory", background_quota=True),
    StoreConfiguration("lru+sessions", "memory", background_quota=False, sessions=True),
    StoreConfiguration("file-lru", "file", background_quota=False),
    StoreConfiguration("file-lru+quotas", "file", background_quota=True),
    StoreConfiguration("file-lru+sessions", "file", background_quota=False, sessions=True),
)
#: How long a session's retention lasts past its last request (longer than any pause of the trace: a
#: session's prefix is retained until the session ends; the budget bounds what that protects).
SESSION_TTL_S = 3600.0
STORE_CHOICES = ("memory", "file", "both")


def configurations_for(store: str) -> tuple[StoreConfiguration, ...]:
    """The configurations of ``--store memory|file|both`` (the first is the baseline of the differences)."""
    assert store in STORE_CHOICES, store
    return tuple(c for c in CONFIGURATIONS if store in ("both", c.scheme))


@contextlib.contextmanager
def opened_store(
    configuration: StoreConfiguration, capacity_bytes: int, quota_bytes: int, scratch: Path
) -> Iterator[Store]:
    """A fresh, empty store of ``configuration``, removed afterwards. ``StoreError`` if the store refuses
    the configuration (e.g. a store without quotas)."""
    extra = f"&{configuration.url_params}" if configuration.url_params else ""
    if configuration.scheme == "memory":
        name = f"bench-agentic-{uuid.uuid4().hex[:12]}"
        url = f"memory://{name}?capacity={capacity_bytes}{extra}"
        if configuration.background_quota:
            url += f"&quotas={BACKGROUND_TENANT}:{quota_bytes}"
        try:
            store = open_store(url)
        except StoreError:
            drop_memory_store(name)
            raise
        try:
            yield store
        finally:
            store.close()
            drop_memory_store(name)
        return
    directory = scratch / f"store-{uuid.uuid4().hex[:12]}"
    try:
        store = open_store(f"file://{directory}?capacity={capacity_bytes}{extra}")
        try:
            if configuration.background_quota:
                _set_file_quota(directory, quota_bytes)
            yield store
        finally:
            store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _set_file_quota(directory: Path, quota_bytes: int) -> None:
    """Give the background tenant of the file store in ``directory`` its quota (the directory's quota file)."""
    try:
        from hybridkv.store.quotas import write_quotas
    except ImportError as error:
        raise StoreError(f"file store quotas are not available: {error}") from None
    write_quotas(directory, {BACKGROUND_TENANT: quota_bytes})


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def run_agentic_bench(
    workload: AgenticWorkload,
    *,
    seed: int = 0,
    num_rounds: int = 5,
    capacity_fraction: float = 0.1,
    background_quota_fraction: float = 0.2,
    configurations: Sequence[StoreConfiguration] = CONFIGURATIONS,
    attention_value_bytes: int = DEFAULT_ATTENTION_VALUE_BYTES,
    state_value_bytes: int = DEFAULT_STATE_VALUE_BYTES,
    sample_every: Mapping[str, int] | None = None,
    scratch_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay the traces of seeds ``seed .. seed + num_rounds - 1`` through every configuration, round ``r``
    in an order rotated by ``r``, each on a fresh store of ``capacity_fraction`` of that trace's working set.
    Returns the report (``rows``, ``targets``, ``shape``, ``windows``, every run under ``rounds``)."""
    assert num_rounds >= 1 and capacity_fraction > 0 and 0 < background_quota_fraction <= 1, (
        num_rounds,
        capacity_fraction,
        background_quota_fraction,
    )
    assert configurations, "no configuration to run"
    sample_every = {**DEFAULT_SAMPLE_EVERY, **(sample_every or {})}
    from hybridkv.bench.store import bench_scratch_dir

    config_to_runs: dict[str, list[ReplayResult]] = {c.name: [] for c in configurations}
    unavailable: dict[str, str] = {}
    traces: list[AgenticTrace] = []
    working_sets: list[int] = []
    capacities: list[int] = []
    with bench_scratch_dir(scratch_dir) as scratch_text:
        scratch = Path(scratch_text)
        for round_index in range(num_rounds):
            trace = generate_trace(workload, seed + round_index)
            working_set = trace.working_set_bytes(attention_value_bytes, state_value_bytes)
            capacity = max(1, int(capacity_fraction * working_set))
            quota = max(1, int(background_quota_fraction * capacity))
            traces.append(trace)
            working_sets.append(working_set)
            capacities.append(capacity)
            shift = round_index % len(configurations)
            for configuration in [*configurations[shift:], *configurations[:shift]]:
                if configuration.name in unavailable:
                    continue
                try:
                    with opened_store(configuration, capacity, quota, scratch) as store:
                        result = replay_trace(
                            trace,
                            store,
                            configuration=configuration.name,
                            capacity_bytes=capacity,
                            reference_quota_bytes=quota,
                            attention_value_bytes=attention_value_bytes,
                            state_value_bytes=state_value_bytes,
                            sample_every=sample_every[configuration.scheme],
                            sessions=configuration.sessions,
                        )
                except StoreError as error:
                    unavailable[configuration.name] = str(error)
                    config_to_runs[configuration.name].clear()
                    continue
                config_to_runs[configuration.name].append(result)
                if progress is not None:
                    progress(
                        f"round {round_index + 1}/{num_rounds} {configuration.name}: "
                        f"hit {result.hit_fraction:.3f} in {result.seconds:.1f}s"
                    )
    measured = [c for c in configurations if c.name not in unavailable]
    baseline = measured[0].name if measured else None
    first = traces[0]
    ideal_hit_fraction = statistics.median(
        sum(trace.ideal_hit_tokens()) / max(1, sum(r.num_prompt_tokens for r in trace.requests))
        for trace in traces
    )
    rows = [
        _row(c, config_to_runs[c.name], config_to_runs[baseline] if baseline else [], baseline, first.tenants)
        for c in measured
    ]
    return {
        "benchmark": "agentic",
        "workload": asdict(workload),
        "seed": seed,
        "num_rounds": num_rounds,
        "capacity_fraction": capacity_fraction,
        "background_quota_fraction": background_quota_fraction,
        "attention_value_bytes": attention_value_bytes,
        "state_value_bytes": state_value_bytes,
        "sample_every": dict(sample_every),
        "geometry": f"full attention block {workload.block_tokens} + Mamba state block {workload.block_tokens}, TP 1",
        "shape": first.shape(),
        "working_set_bytes": working_sets,
        "capacity_bytes": capacities,
        "baseline": baseline,
        "ideal_hit_fraction": ideal_hit_fraction,
        "rows": rows,
        "unavailable": [{"configuration": name, "error": error} for name, error in unavailable.items()],
        "targets": _targets(rows, baseline),
        "windows": {
            "num_requests": len(first.requests),
            "ideal": _windows(
                first.ideal_hit_tokens(), [r.num_prompt_tokens for r in first.requests], NUM_WINDOWS
            ),
            **{name: runs[0].window_hit_fractions for name, runs in config_to_runs.items() if runs},
        },
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rounds": {name: [_run_dict(run) for run in runs] for name, runs in config_to_runs.items() if runs},
    }


def _run_dict(run: ReplayResult) -> dict[str, Any]:
    return {**asdict(run), "hit_fraction": run.hit_fraction, "agentic_hit_fraction": run.agentic_hit_fraction}


_MIB = float(1 << 20)


def _row(
    configuration: StoreConfiguration,
    runs: Sequence[ReplayResult],
    baseline_runs: Sequence[ReplayResult],
    baseline: str | None,
    tenants: Sequence[str],
) -> dict[str, Any]:
    """The table row of one configuration: medians over its rounds, differences to the baseline per round."""
    hit = _spread([run.hit_fraction for run in runs])
    is_baseline = configuration.name == baseline
    points = _spread(
        [
            100.0 * (run.hit_fraction - base.hit_fraction)
            for run, base in zip(runs, baseline_runs, strict=True)
        ]
    )
    return {
        "configuration": configuration.name,
        "store": configuration.scheme,
        "hit_fraction": hit["median"],
        "hit_spread": f"[{hit['min']:.3f}, {hit['max']:.3f}]",
        "hit_fraction_min": hit["min"],
        "hit_fraction_max": hit["max"],
        "agentic_hit_fraction": statistics.median(run.agentic_hit_fraction for run in runs),
        "points_vs_baseline": None if is_baseline else points["median"],
        "points_spread": None if is_baseline else f"[{points['min']:+.1f}, {points['max']:+.1f}]",
        "points_vs_baseline_min": None if is_baseline else points["min"],
        "points_vs_baseline_max": None if is_baseline else points["max"],
        "baseline": baseline,
        "written_mib": statistics.median(run.bytes_written for run in runs) / _MIB,
        "read_mib": statistics.median(run.bytes_read for run in runs) / _MIB,
        "evicted_mib_by_tenant": {
            tenant: statistics.median(run.tenant_to_bytes_evicted.get(tenant, 0) for run in runs) / _MIB
            for tenant in tenants
        },
        "agentic_evicted_mib": statistics.median(
            sum(v for t, v in run.tenant_to_bytes_evicted.items() if t != BACKGROUND_TENANT) for run in runs
        )
        / _MIB,
        "agentic_evicted_by_over_quota_mib": statistics.median(
            run.agentic_bytes_evicted_over_quota for run in runs
        )
        / _MIB,
        "evicted_by_over_quota_max_mib": max(
            sum(run.tenant_to_bytes_evicted_over_quota.values()) for run in runs
        )
        / _MIB,
        "evicted_by_over_quota_mib_by_tenant": {
            tenant: statistics.median(run.tenant_to_bytes_evicted_over_quota.get(tenant, 0) for run in runs)
            / _MIB
            for tenant in tenants
        },
        "evicted_by_background_within_quota_mib": statistics.median(
            sum(run.tenant_to_bytes_evicted_within_quota.values()) for run in runs
        )
        / _MIB,
        "num_over_quota_puts": sum(run.num_over_quota_puts for run in runs),
        "background_peak_of_quota": max(
            run.quota_tenant_peak_bytes / max(1, run.reference_quota_bytes) for run in runs
        ),
        "load_failures": sum(run.num_load_failures for run in runs),
        "put_failures": sum(run.num_put_failures for run in runs),
        "seconds": statistics.median(run.seconds for run in runs),
        "num_rounds": len(runs),
    }


def _targets(rows: Sequence[Mapping[str, Any]], baseline: str | None) -> list[dict[str, Any]]:
    """The issue's target per configuration (>= 15 points over the baseline), and for the configurations
    that set a quota: 0 bytes of any tenant evicted by the background's puts while it was over its quota
    (what the store did: listings around each of its puts)."""
    served = [
        target_row(
            f"{row['configuration']}: prompt tokens served vs {baseline}, points",
            row["points_vs_baseline"],
            ">=",
            TARGET_POINTS_OVER_LRU,
        )
        for row in rows
        if row["configuration"] != baseline
    ]
    protected = [
        target_row(
            f"{row['configuration']}: MiB of other tenants evicted by background puts over its quota (max)",
            row["evicted_by_over_quota_max_mib"],
            "==",
            0,
        )
        for row in rows
        if row["configuration"].endswith("+quotas")
    ]
    return served + protected


#: Columns of the main table.
TABLE_COLUMNS = [
    "configuration",
    "hit_fraction",
    "hit_spread",
    "agentic_hit_fraction",
    "points_vs_baseline",
    "points_spread",
    "written_mib",
    "agentic_evicted_mib",
    "agentic_evicted_by_over_quota_mib",
    "seconds",
]


def evicted_table_rows(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and columns of the evicted-MiB-by-tenant table (medians over rounds)."""
    tenants = list(report["shape"]["tenants"])
    rows = [{"configuration": row["configuration"], **row["evicted_mib_by_tenant"]} for row in report["rows"]]
    return rows, ["configuration", *tenants]


def evicted_by_background_table_rows(report: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and columns of the table of what the background's puts evicted of the other tenants (medians
    over rounds): per tenant while it was over its quota, in all while within it; the over-quota puts (all
    rounds) and the most it held after a put, as a fraction of its quota."""
    tenants = [tenant for tenant in report["shape"]["tenants"] if tenant != BACKGROUND_TENANT]
    over = [f"{tenant} over quota" for tenant in tenants]
    rows = [
        {
            "configuration": row["configuration"],
            **{
                label: row["evicted_by_over_quota_mib_by_tenant"][tenant]
                for label, tenant in zip(over, tenants, strict=True)
            },
            "all within quota": row["evicted_by_background_within_quota_mib"],
            "over-quota puts": row["num_over_quota_puts"],
            "background peak / quota": f"{row['background_peak_of_quota']:.2f}",
        }
        for row in report["rows"]
    ]
    return rows, ["configuration", *over, "all within quota", "over-quota puts", "background peak / quota"]


def describe_shape(report: Mapping[str, Any]) -> str:
    """The trace's shape and the run's setup, as the lines the command prints above its tables."""
    s = report["shape"]
    kinds = s["num_requests_by_kind"]
    p10, p90 = s["turns_per_session_p10_p90"]
    working = statistics.median(report["working_set_bytes"]) / _MIB
    capacity = statistics.median(report["capacity_bytes"]) / _MIB
    last_seed = report["seed"] + report["num_rounds"] - 1
    sessions = (
        f"trace (seed {s['seed']}; tokens scaled 1/{s['token_scale']}): {s['num_sessions']} sessions, turns "
        f"median {s['turns_per_session_median']:g} (p10-p90 {p10:g}-{p90:g}), sub-agents in "
        f"{s['subagent_session_share']:.0%} of sessions ({s['num_subagents']}, median "
        f"{s['subagent_turns_median']:g} turns)"
    )
    requests = (
        f"  {s['num_requests']} requests ({kinds['turn']} turns, {kinds['subagent']} sub-agent, "
        f"{kinds['one_off']} one-off = {s['one_off_share']:.0%}); prompt median {s['prompt_tokens_median']:g} "
        f"tokens, mean {s['prompt_tokens_mean']:.0f} (~{s['prompt_tokens_mean_real'] / 1000:.0f}K real); "
        f"{s['num_agent_types']} agent types x {s['system_prompt_tokens']}-token system prompt; tenants "
        f"{', '.join(s['tenants'])}"
    )
    pauses = (
        f"  pauses: {s['num_tool_pauses']} tool (median {s['tool_pause_median_s']:.1f}s), "
        f"{s['num_human_pauses']} human (median {s['human_pause_median_s']:.0f}s); span {s['span_s'] / 60:.0f} "
        f"min; prefix reuse of agentic requests {s['prefix_reuse_agentic']:.1%}; an unbounded store serves "
        f"{s['ideal_hit_fraction']:.1%} of all prompt tokens"
    )
    store = (
        f"store: {report['geometry']}, {report['attention_value_bytes'] >> 10} KiB per block, "
        f"{report['state_value_bytes'] >> 10} KiB per state; working set {working:.1f} MiB, capacity "
        f"{report['capacity_fraction']:g} of it = {capacity:.1f} MiB; background quota "
        f"{report['background_quota_fraction']:g} of capacity"
    )
    rounds = (
        f"{report['num_rounds']} interleaved rounds (seeds {report['seed']}..{last_seed}): medians, spread "
        f"[min, max]; points vs {report['baseline']} taken per round"
    )
    return f"{sessions}\n{requests}\n{pauses}\n{store}\n{rounds}"


def plot_report(report: Mapping[str, Any], path: Path) -> Path | None:
    """The hit-token fraction over the first round's trace (windows of requests), one line per configuration
    and the unbounded store's dashed; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    windows = report["windows"]
    num_requests = windows["num_requests"]
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, fractions in windows.items():
        if name == "num_requests":
            continue
        size = num_requests / max(1, len(fractions))
        positions = [(index + 0.5) * size for index in range(len(fractions))]
        style = {"linestyle": "--", "color": "grey"} if name == "ideal" else {}
        label = "unbounded store" if name == "ideal" else name
        axes.plot(positions, fractions, label=label, **style)
    axes.set_xlabel(f"request (trace order, seed {report['seed']})")
    axes.set_ylabel("prompt tokens served by the store")
    axes.set_ylim(0, 1)
    axes.set_title(f"agentic trace, capacity {report['capacity_fraction']:g} x working set")
    axes.legend(fontsize="small")
    return save_figure(figure, path)
