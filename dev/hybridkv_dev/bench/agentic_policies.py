"""Eviction orders from the literature on the agentic trace (``hybridkv bench agentic-policies``).

Which order should the store evict in? ``hybridkv bench agentic`` measures the stores as they are (LRU, with
quotas, with session retention); this models the orders the store does not implement, on the same traces
(:func:`hybridkv_dev.bench.agentic.generate_trace`) and the same access pattern, so that the choice rests on
measurement rather than on the literature alone. Per request, in trace order: the hit is the deepest
whole-block boundary (at most the prompt less one token) at which a Mamba state is held and every attention
block before it is held (the connector's lookup on this geometry, ``bench_geometry``); the hit's entries are
accessed, in prefix order; then every block past the hit and the state at the prompt's last whole block are
inserted (the connector's save). Entries are 16 KiB per attention block and 32 KiB per state, capacities a
fraction of the trace's working set, as in ``hybridkv bench agentic``.

The orders (:data:`POLICIES`):

- ``lru``: least recently used (the memory store's order, and the file store's over real time);
- ``lru-tail-first``: LRU, but a hit touches its entries deepest first, so a cold prefix loses its tail
  before its head (a radix tree's leaf-first eviction, SGLang's RadixAttention; for a hybrid model a prefix
  cut from its tail keeps the earlier turns' states usable, one cut from its head keeps nothing);
- ``lru-superseded-states``: LRU, hybrid-aware: when a save stores a Mamba state deeper than the state its
  request loaded, the loaded one is superseded (the session's next turn hits the deeper one) and goes to
  the cold end, first to be evicted; a state is 2x an attention block here, and a session's superseded
  states are dead weight beside its live prefix;
- ``s3fifo``: S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10 % of capacity) that one-hit entries leave
  quickly, a main FIFO with up to 3 reinsertions on access, and a ghost list that admits an entry evicted
  from the small queue straight into the main one when it comes back;
- ``lru-no-one-offs``: LRU that never stores the one-off requests' blocks (an oracle: no admission policy
  knows which prompts will never come back; it bounds what admission control could buy);
- ``clairvoyant``: Belady's MIN made prefix-aware (an oracle: it reads the trace's future). It evicts the
  entry whose next use lies furthest ahead -- an attention block's next use is the next request of its
  tenant whose unbounded-store hit covers it, a state's the next request whose unbounded-store hit ends at
  it -- and, among entries next used by the same request, the deepest first, so a prefix is cut from its
  tail (plain MIN breaks such ties arbitrarily and leaves prefixes with holes: it served less than LRU).
  Not a proven optimum (entries differ in size, and a prefix is worth something only whole), but what a
  policy that knew every session's next turn would serve: the reference any online order is held to;
- ``unbounded``: the ceiling (``AgenticTrace.ideal_hit_tokens``).

A model, not a store: no bytes move, nothing is framed. Its ``lru`` is checked against the memory store's
replay in the tests (same trace, same capacity: the same hit tokens to within the frame headers' share of
capacity).
"""

from __future__ import annotations

import heapq
import statistics
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from hybridkv.bench.report import target_row

from hybridkv_dev.bench.agentic import (
    DEFAULT_ATTENTION_VALUE_BYTES,
    DEFAULT_STATE_VALUE_BYTES,
    AgenticTrace,
    AgenticWorkload,
    RequestKind,
    generate_trace,
)

__all__ = [
    "POLICIES",
    "POLICY_COLUMNS",
    "ClairvoyantModel",
    "LruModel",
    "Policy",
    "S3FifoModel",
    "model_hit_fraction",
    "run_policy_model",
]

#: An entry: (tenant, "a" attention block / "s" Mamba state, the block hash of its boundary).
Entry = tuple[str, str, bytes]


class CacheModel(Protocol):
    def start_request(self, index: int) -> None:
        """The replay moves to the trace's request ``index`` (only an oracle needs the clock)."""

    def holds(self, entry: Entry) -> bool: ...

    def access(self, entry: Entry) -> None: ...

    def insert(self, entry: Entry, size: int) -> None: ...


class LruModel:
    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[Entry, int] = OrderedDict()
        self.used = 0

    def start_request(self, index: int) -> None:
        pass

    def holds(self, entry: Entry) -> bool:
        return entry in self.entries

    def access(self, entry: Entry) -> None:
        self.entries.move_to_end(entry)

    def demote(self, entry: Entry) -> None:
        """``entry`` goes first at the next eviction."""
        if entry in self.entries:
            self.entries.move_to_end(entry, last=False)

    def insert(self, entry: Entry, size: int) -> None:
        if entry in self.entries:
            self.entries.move_to_end(entry)
            return
        self.entries[entry] = size
        self.used += size
        while self.used > self.capacity:
            _, evicted = self.entries.popitem(last=False)
            self.used -= evicted


class S3FifoModel:
    """S3-FIFO over sized entries: ``small`` (FIFO, ``small_share`` of capacity), ``main`` (FIFO with
    reinsertion while its access count is above 0, counts capped at 3) and ``ghost`` (keys only, as many as
    both queues hold)."""

    def __init__(self, capacity: float, small_share: float = 0.1) -> None:
        self.capacity = capacity
        self.small_capacity = capacity * small_share
        self.small: OrderedDict[Entry, int] = OrderedDict()
        self.main: OrderedDict[Entry, int] = OrderedDict()
        self.ghost: OrderedDict[Entry, None] = OrderedDict()
        self.freq: dict[Entry, int] = {}
        self.small_used = 0
        self.main_used = 0

    def start_request(self, index: int) -> None:
        pass

    def holds(self, entry: Entry) -> bool:
        return entry in self.small or entry in self.main

    def access(self, entry: Entry) -> None:
        self.freq[entry] = min(self.freq.get(entry, 0) + 1, 3)

    def insert(self, entry: Entry, size: int) -> None:
        if self.holds(entry):
            self.access(entry)
            return
        if entry in self.ghost:
            del self.ghost[entry]
            self.main[entry] = size
            self.main_used += size
        else:
            self.small[entry] = size
            self.small_used += size
        self.freq[entry] = 0
        while self.small_used + self.main_used > self.capacity:
            self._evict()

    def _evict(self) -> None:
        if self.small and (self.small_used > self.small_capacity or not self.main):
            entry, size = self.small.popitem(last=False)
            self.small_used -= size
            if self.freq[entry] > 0:  # accessed while in the small queue: promoted
                self.freq[entry] = 0
                self.main[entry] = size
                self.main_used += size
                return
            del self.freq[entry]
            self.ghost[entry] = None
            while len(self.ghost) > len(self.small) + len(self.main):
                self.ghost.popitem(last=False)
            return
        while True:
            entry, size = self.main.popitem(last=False)
            if self.freq[entry] > 0:
                self.freq[entry] -= 1
                self.main[entry] = size  # reinserted at the tail
                continue
            self.main_used -= size
            del self.freq[entry]
            return


#: No further use.
_NEVER = 1 << 62


class ClairvoyantModel:
    """Prefix-aware MIN over sized entries: evicts the entry whose next use (``entry_to_uses``: the request
    indexes that use it, ascending) is furthest ahead, the deepest (``entry_to_depth``) of those first.
    ``start_request`` moves its clock; an entry's uses at or before the clock are past, and a held entry
    whose use passes is queued again at its next one (whether or not the replay touched it: a request
    whose hit stopped short of its forecast passes uses it did not make)."""

    def __init__(
        self, capacity: float, entry_to_uses: dict[Entry, list[int]], entry_to_depth: dict[Entry, float]
    ) -> None:
        self.capacity = capacity
        self.entry_to_uses = entry_to_uses
        self.entry_to_depth = entry_to_depth
        self.entry_to_size: dict[Entry, int] = {}
        self.entry_to_next_use_index: dict[Entry, int] = {}
        # (-next use, -depth, entry); stale items (a next use that has passed, an entry gone) are skipped.
        self.heap: list[tuple[int, float, Entry]] = []
        self.used = 0
        self.now = -1
        self.request_to_entries: dict[int, list[Entry]] = defaultdict(list)
        for entry, uses in entry_to_uses.items():
            for index in uses:
                self.request_to_entries[index].append(entry)

    def start_request(self, index: int) -> None:
        assert index > self.now, f"the replay went back from request {self.now} to {index}"
        passed = range(self.now, index)
        self.now = index
        for past in passed:
            for entry in self.request_to_entries.get(past, ()):
                if entry in self.entry_to_size:
                    self._push(entry)

    def _next_use(self, entry: Entry) -> int:
        uses = self.entry_to_uses.get(entry, [])
        position = self.entry_to_next_use_index.get(entry, 0)
        while position < len(uses) and uses[position] <= self.now:
            position += 1
        self.entry_to_next_use_index[entry] = position
        return uses[position] if position < len(uses) else _NEVER

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self.heap, (-self._next_use(entry), -self.entry_to_depth[entry], entry))

    def holds(self, entry: Entry) -> bool:
        return entry in self.entry_to_size

    def access(self, entry: Entry) -> None:
        self._push(entry)

    def insert(self, entry: Entry, size: int) -> None:
        if entry in self.entry_to_size:
            self._push(entry)
            return
        self.entry_to_size[entry] = size
        self.used += size
        self._push(entry)
        while self.used > self.capacity:
            negative_next_use, negative_depth, victim = heapq.heappop(self.heap)
            if victim not in self.entry_to_size:
                continue
            next_use = self._next_use(victim)
            if next_use != -negative_next_use:  # its use then has passed: queue it at its next one
                heapq.heappush(self.heap, (-next_use, negative_depth, victim))
                continue
            self.used -= self.entry_to_size.pop(victim)

    @classmethod
    def of_trace(cls, trace: AgenticTrace, capacity: float) -> ClairvoyantModel:
        """The oracle of ``trace``: an attention block is used by every request whose unbounded-store hit
        covers it, a state by every request whose unbounded-store hit ends at it."""
        block_tokens = trace.workload.block_tokens
        entry_to_uses: dict[Entry, list[int]] = defaultdict(list)
        entry_to_depth: dict[Entry, float] = {}
        for index, (request, hit_tokens) in enumerate(
            zip(trace.requests, trace.ideal_hit_tokens(), strict=True)
        ):
            tenant, hashes = request.tenant, request.block_hashes
            for depth, block_hash in enumerate(hashes):
                entry_to_depth[(tenant, "a", block_hash)] = depth
                # a state ends its block: deeper than the block, shallower than the next one
                entry_to_depth[(tenant, "s", block_hash)] = depth + 0.5
            num_hit_blocks = hit_tokens // block_tokens
            for block_hash in hashes[:num_hit_blocks]:
                entry_to_uses[(tenant, "a", block_hash)].append(index)
            if num_hit_blocks:
                entry_to_uses[(tenant, "s", hashes[num_hit_blocks - 1])].append(index)
        return cls(capacity, dict(entry_to_uses), entry_to_depth)


@dataclass(frozen=True)
class Policy:
    """How the replay drives one modelled order."""

    #: the cache, given the trace (only the oracles read it) and the capacity
    make_cache: Callable[[AgenticTrace, float], CacheModel]
    #: a hit touches its entries deepest first
    tail_first: bool = False
    #: the one-off requests' blocks are stored
    stores_one_offs: bool = True
    #: a save that stores a state deeper than the one its request loaded demotes the loaded one (LRU only)
    demotes_superseded_states: bool = False


def _online(make: Callable[[float], CacheModel]) -> Callable[[AgenticTrace, float], CacheModel]:
    return lambda _trace, capacity: make(capacity)


#: policy name -> how the replay drives it
POLICIES: dict[str, Policy] = {
    "lru": Policy(_online(LruModel)),
    "lru-tail-first": Policy(_online(LruModel), tail_first=True),
    "lru-superseded-states": Policy(_online(LruModel), demotes_superseded_states=True),
    "s3fifo": Policy(_online(S3FifoModel)),
    "lru-no-one-offs": Policy(_online(LruModel), stores_one_offs=False),
    "clairvoyant": Policy(ClairvoyantModel.of_trace),
}


def model_hit_fraction(
    trace: AgenticTrace,
    policy: str,
    capacity_bytes: float,
    *,
    attention_value_bytes: int = DEFAULT_ATTENTION_VALUE_BYTES,
    state_value_bytes: int = DEFAULT_STATE_VALUE_BYTES,
) -> float:
    """Prompt tokens served from a store evicting by ``policy`` over all prompt tokens of ``trace``."""
    driven = POLICIES[policy]
    cache = driven.make_cache(trace, capacity_bytes)
    block_tokens = trace.workload.block_tokens
    served = total = 0
    for index, request in enumerate(trace.requests):
        cache.start_request(index)
        tenant, hashes = request.tenant, request.block_hashes
        total += request.num_prompt_tokens
        cap = min(request.num_prompt_tokens - 1, len(hashes) * block_tokens) // block_tokens
        num_held = 0
        while num_held < cap and cache.holds((tenant, "a", hashes[num_held])):
            num_held += 1
        hit = next((n for n in range(num_held, 0, -1) if cache.holds((tenant, "s", hashes[n - 1]))), 0)
        touched: list[Entry] = [(tenant, "a", h) for h in hashes[:hit]]
        if hit:
            touched.append((tenant, "s", hashes[hit - 1]))
        for entry in reversed(touched) if driven.tail_first else touched:
            cache.access(entry)
        served += hit * block_tokens
        if request.kind is RequestKind.ONE_OFF and not driven.stores_one_offs:
            continue
        for h in hashes[hit:]:
            cache.insert((tenant, "a", h), attention_value_bytes)
        if len(hashes) > hit:
            cache.insert((tenant, "s", hashes[-1]), state_value_bytes)
            if hit and driven.demotes_superseded_states:
                assert isinstance(cache, LruModel), f"policy {policy!r}: demotion is LRU's, not {type(cache)}"
                cache.demote((tenant, "s", hashes[hit - 1]))
    return served / total if total else 0.0


#: The issue's bar: prompt points more served than plain LRU at the same capacity.
TARGET_POINTS = 15.0
#: The policies that know the future (bounds, not candidates).
ORACLES = ("lru-no-one-offs", "clairvoyant")

#: the table's columns
POLICY_COLUMNS = ["capacity_fraction", "policy", "hit_fraction", "spread", "points_vs_lru", "points_spread"]


def run_policy_model(
    workload: AgenticWorkload,
    *,
    seed: int = 0,
    num_rounds: int = 5,
    capacity_fractions: Sequence[float] = (0.02, 0.05, 0.1),
    policies: Sequence[str] = tuple(POLICIES),
) -> dict[str, Any]:
    """Every policy at every capacity on the traces of seeds ``seed .. seed + num_rounds - 1``: medians
    over rounds with [min, max], and the points against ``lru`` taken per round (same trace)."""
    assert num_rounds >= 1 and capacity_fractions, (num_rounds, capacity_fractions)
    unknown = [p for p in policies if p not in POLICIES]
    assert not unknown, f"unknown policies {unknown}; known: {list(POLICIES)}"
    traces = [generate_trace(workload, seed + r) for r in range(num_rounds)]
    ideal = [sum(t.ideal_hit_tokens()) / max(1, sum(r.num_prompt_tokens for r in t.requests)) for t in traces]
    rows: list[dict[str, Any]] = []
    for fraction in capacity_fractions:
        capacities = [
            fraction * t.working_set_bytes(DEFAULT_ATTENTION_VALUE_BYTES, DEFAULT_STATE_VALUE_BYTES)
            for t in traces
        ]
        by_policy = {
            policy: [model_hit_fraction(t, policy, c) for t, c in zip(traces, capacities, strict=True)]
            for policy in dict.fromkeys(["lru", *policies])
        }
        for policy, fractions in [*by_policy.items(), ("unbounded", ideal)]:
            points = [100 * (f - b) for f, b in zip(fractions, by_policy["lru"], strict=True)]
            rows.append(
                {
                    "capacity_fraction": fraction,
                    "policy": policy,
                    "hit_fraction": statistics.median(fractions),
                    "spread": f"[{min(fractions):.3f}, {max(fractions):.3f}]",
                    "points_vs_lru": None if policy == "lru" else statistics.median(points),
                    "points_spread": None if policy == "lru" else f"[{min(points):+.1f}, {max(points):+.1f}]",
                    "rounds": fractions,
                }
            )
    targets = []
    for fraction in capacity_fractions:
        candidates = [
            row
            for row in rows
            if row["capacity_fraction"] == fraction and row["policy"] not in ("lru", "unbounded", *ORACLES)
        ]
        best = max(candidates, key=lambda row: row["points_vs_lru"], default=None)
        targets.append(
            target_row(
                f"capacity {fraction:g} of the working set: best order"
                + (f" ({best['policy']})" if best is not None else "")
                + " - lru, points",
                None if best is None else best["points_vs_lru"],
                ">=",
                TARGET_POINTS,
            )
        )
    return {
        "benchmark": "agentic-policies",
        "targets": targets,
        "workload": asdict(workload),
        "seed": seed,
        "num_rounds": num_rounds,
        "capacity_fractions": list(capacity_fractions),
        "rows": rows,
    }
