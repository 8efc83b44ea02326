"""The agentic trace: its workload, its requests and chains, and the seeded generator (``generate_trace``)."""

from __future__ import annotations

import enum
import hashlib
import heapq
import statistics
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

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
