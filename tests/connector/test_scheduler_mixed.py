"""Mixed hits are exact: one request whose prefix is partly vLLM's LOCAL prefix cache, partly the store.

vLLM's real ``Scheduler`` with the connector and simulated worker ranks over one shared store, on the
scheduler matrix's geometries (full + Mamba DCP 1, full + sliding window DCP 1, MLA + Mamba DCP 2/4/8).
A cold engine stores X = P + Q and every prefix P used below (a Mamba state is only stored at a boundary a
cold run handed off, so P's own run stores one at P's served boundary). Then, on a fresh engine:

- mixed hit, per local-hit shape (P = 1 scheduler block + 1, 1 block + a hash-unit tail, 2 blocks + a tail,
  257 tokens: the last window / Mamba checkpoint before X's served boundary): P runs (its prefix loaded
  from the store) and finishes, its blocks stay in vLLM's block pool; X runs: vLLM's local hit (a
  scheduler-block-aligned cut of its own hit, which may end inside a block or a window) is > 0, the
  connector's external tokens are > 0, together they are X's served boundary, and every slot / state the
  cluster checks on every rank equals a recompute;
- a divergent local prefix: P + R (R leaving Q after P) runs first; X's local hit never crosses the
  divergence, and whatever the split, the load is exact;
- under a fault: one rank fails one external full-attention block of the mixed load; the request
  truncates, restarts and retries (capped) or recomputes from its local hit.

Everywhere: no planned load writes a block below the request's local hit or a block vLLM holds as a
prefix-cache page (``Probe.before_load``, every step), every prompt slot of X is exact once its prefill is
done (local, loaded and computed alike), X's outputs equal the cold run's, and nothing is left pinned or
live (``Cluster.assert_empty``: block pool, connector, audit-log replay).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hybridkv.lifecycle.kinds import GroupKind
from hybridkv_dev.devkit.cluster import Cluster, hybrid_config, kv_value
from support.scheduler import PROMPT, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

GEOMETRIES = [
    pytest.param(("full_mamba", 1, 2), id="full+mamba-dcp1"),
    pytest.param(("full_swa", 1, 2), id="full+swa-dcp1"),
    pytest.param(("mla_mamba", 2, 2), id="mla+mamba-dcp2"),
    pytest.param(("mla_mamba", 4, 4), id="mla+mamba-dcp4"),
    pytest.param(("mla_mamba", 8, 8), id="mla+mamba-dcp8"),
]

#: P's length by local-hit shape, from the scheduler block S (32 / 64 / 128 tokens across the matrix).
SHAPES: dict[str, Callable[[int], int]] = {
    "1blk": lambda s: s + 1,
    "1blk+tail": lambda s: s + 17,
    "2blk+tail": lambda s: 2 * s + 17,
    "near-end": lambda s: 257,
}
#: Where P + R leaves X, by scheduler block: inside a hash unit past one block; at the end of two.
DIVERGE: dict[str, Callable[[int], int]] = {"mid-unit": lambda s: s + 24, "at-block": lambda s: 2 * s}


def served_boundary(cl: Cluster, n: int) -> int:
    """What a cold prefill of ``n`` tokens leaves in the store (the matrix's ``served_boundary``)."""
    a = int(cl.geo.geometry.hit_alignment)
    return (n - 1) // a * a


@dataclass(frozen=True)
class Stored:
    """One geometry after the cold runs: its configs, X, and the cold outputs (X's and every P's)."""

    vc: Any
    kvc: Any
    x: list[int]
    cold_out: dict[str, list[int]]


@pytest.fixture(scope="module", params=GEOMETRIES)
def stored(request: pytest.FixtureRequest) -> Stored:
    """A cold engine stores X and every prefix P of ``SHAPES`` on a fresh store (P + R loads from these)."""
    kind, dcp, tp = request.param
    vc, kvc = hybrid_config(kind, dcp=dcp, tp=tp)
    x = tokens(11)
    cold = Cluster(vc, kvc)
    try:
        s = cold.sched.block_size
        cold.add("x", x)
        for n in {f(s) for f in SHAPES.values()}:
            cold.add(f"p{n}", x[:n])
        cold.run()
        cold.assert_empty()
        assert cold.side.stats.totals.get("hit_tokens", 0) == 0
        return Stored(vc, kvc, x, dict(cold.outputs))
    finally:
        cold.shutdown()


class Probe:
    """One fresh engine, instrumented: vLLM's own local hit (``raw``), what it hands the connector and the
    external tokens answered (``asks``); every step checks the planned loads against the local hit."""

    def __init__(self, stored: Stored, *, divergent_local_hits: bool = False) -> None:
        vc = stored.vc
        if divergent_local_hits:
            vc = copy.deepcopy(vc)
            extra = vc.kv_transfer_config.kv_connector_extra_config
            vc.kv_transfer_config.kv_connector_extra_config = {**extra, "divergent_local_hits": True}
        self.cl = cl = Cluster(vc, stored.kvc)
        self.raw: dict[str, int] = {}
        #: vLLM's local hit for a connector that opts in to divergent hits: (tokens, whether it diverged)
        self.raw_for_connector: dict[str, tuple[int, bool]] = {}
        self.asks: list[tuple[str, int, int]] = []
        self.exact: set[str] = set()  # requests whose every prompt slot was checked after the prefill
        self.p_len = 0
        conn, mgr = cl.sched.connector, cl.sched.kv_cache_manager
        ask, local = conn.get_num_new_matched_tokens, mgr.get_computed_blocks

        def recorded_ask(request: Any, num_computed_tokens: int) -> Any:
            ext, is_async = ask(request, num_computed_tokens)
            if ext is not None:
                self.asks.append((request.request_id, num_computed_tokens, ext))
            return ext, is_async

        def recorded_local(request: Any, *args: Any, **kwargs: Any) -> Any:
            hit = local(request, *args, **kwargs)  # vLLM 0.33 passes more arguments than 0.32
            self.raw[request.request_id] = hit[1]
            return hit

        for_connector = mgr.get_computed_blocks_for_connector

        def recorded_for_connector(request: Any, *args: Any, **kwargs: Any) -> Any:
            hit = for_connector(request, *args, **kwargs)  # vLLM 0.33 passes more arguments than 0.32
            self.raw_for_connector[request.request_id] = (hit[1], hit[3])
            return hit

        conn.get_num_new_matched_tokens = recorded_ask
        mgr.get_computed_blocks = recorded_local
        mgr.get_computed_blocks_for_connector = recorded_for_connector

    def split(self, rid: str) -> tuple[int, int]:
        """(local tokens handed to the connector, external tokens it answered) at ``rid``'s last ask."""
        return next((n, ext) for r, n, ext in reversed(self.asks) if r == rid)

    def before_load(self, out: Any) -> None:
        cl = self.cl
        for job in out.kv_connector_metadata.loads:
            if not job.blocks:
                continue  # a declined hit: nothing is written
            local, _ = self.split(job.req_id)
            assert job.boundary > local, (job.req_id, job.boundary, local)
            table = cl.sched.kv_cache_manager.get_block_ids(job.req_id)
            held = {bid for g in cl.geo.groups for bid in table[g.vllm_group_index][: -(-local // g.span)]}
            for ref in job.blocks:
                g = cl.geo.groups[ref.group_index]
                where = (job.req_id, g.kind.value, ref.index, ref.block_id, local)
                assert ref.block_id not in held - {0}, f"a load writes a local-hit block {where}"
                assert cl.pool.blocks[ref.block_id].block_hash is None, f"a load writes a cached page {where}"
                if g.kind is GroupKind.MAMBA:
                    assert ref.key_boundary == job.boundary, where
                else:
                    assert ref.index * g.span >= local, f"a load below the local hit {where}"

    def step(self) -> Any:
        out = self.cl.step(before_load=self.before_load)
        for rid, req in self.cl.sched.requests.items():
            n = req.num_prompt_tokens
            if rid not in self.exact and req.num_computed_tokens >= n:
                assert_prompt_exact(self.cl, rid, n)
                self.exact.add(rid)
        return out

    def run(self, rid: str, toks: list[int]) -> None:
        self.cl.add(rid, toks)
        for _ in range(200):
            if not self.cl.sched.requests and not self.cl.side.has_pending_push_work():
                assert rid in self.exact, rid
                return
            self.step()
        raise AssertionError(f"not drained: {list(self.cl.sched.requests)}")


def assert_prompt_exact(cl: Cluster, rid: str, n: int) -> None:
    """Every attention slot of ``rid``'s first ``n`` tokens still in its block table (sliding window: the
    blocks not yet dropped) equals what a recompute writes, on every rank."""
    table = cl.sched.kv_cache_manager.get_block_ids(rid)
    prefix = cl.prefixes[rid]
    for rank in range(cl.tp):
        for g in cl.geo.groups:
            if g.kind is GroupKind.MAMBA:
                continue
            cache = cl.caches[rank][g.layer_names[0]]
            row = table[g.vllm_group_index]
            shards = cl.dcp if g.span != cache.shape[1] else 1
            for p in range(rank % shards, n, shards):
                bid = row[p // g.span]
                assert bid or g.kind is GroupKind.SLIDING_WINDOW, f"{rid}: slot {p} of group {g} unallocated"
                got = int(cache[bid, p % g.span // shards]) if bid else None
                want = kv_value(prefix, p, rank, g.group_index)
                assert not bid or got == want, f"{rid}: rank {rank} {g.kind.value} slot {p} = {got} != {want}"


@contextmanager
def fresh_engine(
    stored: Stored, shape: str | None = None, *, divergent_local_hits: bool = False
) -> Iterator[Probe]:
    """A fresh engine (no device cache, same store); with ``shape``, P = X[:SHAPES[shape](S)] has run on it
    first: loaded from the store and finished, its pages left cached and free in vLLM's block pool. On
    exit X's outputs equal the cold run's and nothing is pinned or live (the audit log replays clean).
    ``divergent_local_hits``: the connector's ``kv_connector_extra_config`` switch of that name."""
    probe = Probe(stored, divergent_local_hits=divergent_local_hits)
    cl = probe.cl
    try:
        if shape is not None:
            n = probe.p_len = SHAPES[shape](cl.sched.block_size)
            probe.run("p", stored.x[:n])
            assert cl.loads_checked == {"p": served_boundary(cl, n)} and served_boundary(cl, n) > 0
            assert cl.outputs.pop("p") == stored.cold_out[f"p{n}"]
            cached = [b for b in cl.pool.blocks if b.block_hash is not None]
            assert cached and all(b.ref_cnt == 0 for b in cached)
        yield probe
        assert cl.outputs["x"] == stored.cold_out["x"]
        cl.assert_empty()
    finally:
        cl.shutdown()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mixed_hit_is_exact(stored: Stored, shape: str) -> None:
    with fresh_engine(stored, shape) as probe:
        cl, n = probe.cl, probe.p_len
        s, H = cl.sched.block_size, served_boundary(cl, PROMPT)
        before = cl.side.stats.totals.get("hit_tokens", 0)
        probe.run("x", stored.x)
        local, ext = probe.split("x")
        raw = probe.raw["x"]
        # vLLM's own hit is P's (at most P's served boundary or P's last whole block); it hands the
        # connector that hit cut to the scheduler block; the load covers the rest of X's served boundary.
        assert 0 < raw <= max(served_boundary(cl, n), n - n % s), (raw, n)
        assert (local, ext) == (raw - raw % s, H - local) and local > 0 and ext > 0, (raw, local, ext)
        assert cl.side.stats.totals.get("hit_tokens", 0) - before == ext
        assert cl.loads_checked["x"] == H  # local + loaded slots and the Mamba state at H, every rank


@pytest.mark.parametrize("where", list(DIVERGE))
def test_divergent_local_prefix_is_exact(stored: Stored, where: str) -> None:
    with fresh_engine(stored) as probe:
        cl = probe.cl
        d = DIVERGE[where](cl.sched.block_size)
        probe.run("pr", divergent(stored.x, d))  # P + R: its prefix (at most P) from the store
        probe.run("x", stored.x)
        local, ext = probe.split("x")
        assert probe.raw["x"] <= d - d % cl.hash_unit  # vLLM's local hit never crosses the divergence
        assert local + ext == served_boundary(cl, PROMPT) and ext > 0, (local, ext)
        assert cl.loads_checked["x"] == local + ext


@pytest.mark.parametrize("where", list(DIVERGE))
def test_divergent_local_hit_is_completed_from_the_store(stored: Stored, where: str) -> None:
    """``divergent_local_hits``: after P + R, vLLM keeps X's full-attention local hit although the Mamba
    state at its end is not local; the connector loads only the tokens past it and the Mamba state at X's
    served boundary, and every slot and state is exact. (With a sliding-window group the switch stays off:
    vLLM reports the boundary every group agrees on, as without it.)"""
    with fresh_engine(stored, divergent_local_hits=True) as probe:
        cl = probe.cl
        d = DIVERGE[where](cl.sched.block_size)
        kinds = {g.kind for g in cl.geo.groups}
        opted_in = GroupKind.SLIDING_WINDOW not in kinds
        assert cl.sched.connector.supports_divergent_local_hybrid_hits is opted_in
        probe.run("pr", divergent(stored.x, d))
        probe.run("x", stored.x)
        local, ext = probe.split("x")
        H = served_boundary(cl, PROMPT)
        assert local + ext == H and ext > 0, (local, ext)
        assert cl.loads_checked["x"] == H
        if not opted_in:
            assert "x" not in probe.raw_for_connector
            return
        num_local, diverged = probe.raw_for_connector["x"]
        # vLLM hands the connector a scheduler-block cut of its hit, which never crosses the divergence.
        assert num_local <= d and local == num_local - num_local % cl.sched.block_size, (num_local, local, d)
        if cl.dcp == 1 and where == "mid-unit":
            # full + Mamba: the full-attention hit (80) runs past the last Mamba state P + R left locally
            # (64): without the switch vLLM would hand over 64; with it, 80's cut (64) and the load brings
            # the Mamba state at X's served boundary. (Under DCP the Mamba group, block 16, holds a state
            # past the full-attention hit, and vLLM reconciles as without the switch.)
            assert diverged and local > 0, (num_local, local)


def test_resident_full_attention_prefix_is_reused_without_its_mamba_state(stored: Stored) -> None:
    """P's pages stay local but its Mamba state is evicted (block pressure): vLLM's reconciled hit is 0, so
    without ``divergent_local_hits`` the store serves X's whole prefix; with it vLLM keeps P's
    full-attention pages and the store serves only the rest plus the Mamba state. Exact both ways."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    splits: dict[bool, tuple[int, int]] = {}
    for switch in (False, True):
        with fresh_engine(stored, "2blk+tail", divergent_local_hits=switch) as probe:
            cl = probe.cl
            mamba = [g.vllm_group_index for g in cl.geo.groups if g.kind is GroupKind.MAMBA]
            assert cl.sched.connector.supports_divergent_local_hybrid_hits is (switch and bool(mamba))
            if mamba:
                states = {
                    b.block_id
                    for b in cl.pool.blocks
                    if b.block_hash is not None and get_group_id(b.block_hash) in mamba
                }
                assert states, "P left no Mamba state to evict"
                cl.pool.evict_blocks(states)
            probe.run("x", stored.x)
            splits[switch] = probe.split("x")
            assert cl.loads_checked["x"] == served_boundary(cl, PROMPT)
    if not mamba:
        return  # full + sliding window: the switch stays off, both runs are the plain mixed hit
    (local_off, ext_off), (local_on, ext_on) = splits[False], splits[True]
    assert local_off == 0 and local_on > 0, splits
    assert local_off + ext_off == local_on + ext_on, splits


def test_a_failed_external_block_keeps_the_local_hit_and_stays_exact(stored: Stored) -> None:
    # The last rank fails the second-to-last full-attention block k of X's mixed load: TRUNCATED with
    # retry cap k x span; vLLM restarts X from 0, finds P locally again, and the capped retry loads
    # what the store serves in (local hit, cap] -- or nothing: X recomputes past its local hit.
    with fresh_engine(stored, "1blk+tail") as probe:
        cl = probe.cl
        side, last, H = cl.side, cl.tp - 1, served_boundary(cl, PROMPT)
        full = next(g for g in cl.geo.groups if g.kind is GroupKind.FULL)
        k = (H - 1) // full.span - 1
        cap = k * full.span
        assert cap % cl.geo.geometry.hit_alignment == 0

        def fail_one_block(out: Any) -> None:
            probe.before_load(out)
            job = next(j for j in out.kv_connector_metadata.loads if j.req_id == "x")
            ref = next(r for r in job.blocks if r.group_index == full.group_index and r.index == k)
            cl.faults[last].fail_keys = {side.scheme.key(ref.group_index, last, ref.block_hash)}

        cl.add("x", stored.x)
        cl.step(before_load=fail_one_block)
        cl.faults[last].fail_keys = set()
        local, ext = probe.split("x")
        assert local > 0 and local + ext == H and cap >= local, (local, ext, cap)
        lc = side.lifecycle("x")
        assert lc.state == "TRUNCATED" and lc.max_boundary == cap
        assert side.stats.totals["truncations"] == 1 and "x" not in cl.loads_checked
        assert cl.sched.requests["x"].num_computed_tokens == 0  # restarted from 0 (policy "recompute")
        while cl.sched.requests or side.has_pending_push_work():
            assert cl.steps < 200, "not drained"
            probe.step()  # every step: no load below the local hit or into a cached page
        retry_local, retry_ext = probe.split("x")
        assert retry_local == local  # P's pages are still the local hit after the restart
        if retry_ext:
            assert local < local + retry_ext <= cap
            assert cl.loads_checked["x"] == local + retry_ext
        else:
            assert "x" not in cl.loads_checked  # nothing to load: X computes past its local hit
        assert "x" in probe.exact  # every prompt slot exact after the prefill


def divergent(x: list[int], d: int) -> list[int]:
    """X's first ``d`` tokens, then other tokens (the first of them unlike X's)."""
    rng = random.Random(d)
    r = [rng.randrange(3, 30000) for _ in range(PROMPT - d)]
    r[0] = x[d] + 1
    return x[:d] + r
