"""Faults across the wire, while one engine on host B keeps serving the same prompt.

The engine (a pure client of the master + storage node on host A) runs one step per fault; the test
injects the fault between steps. Every step must give the tokens of the first, cold step, finish in
bounded time, and the engine must exit 0 with a clean audit log:

1. storage node SIGKILLed: the master still lists its keys (until ``--client_ttl``), loads fail with
   transfer errors, the request recomputes; a new node comes up empty, the next request misses and saves.
2. master SIGKILLed: the first call runs into the deadline, the breaker opens, lookups are fast misses;
   after a restart (the node re-mounts by itself) and the breaker's reset, the tier is back, cold, and the
   next request hits again.
3. the link shaped within the deadlines (``tc netem`` delay + loss where the kernel has it, else a
   token-bucket rate limit): still hits; shaped beyond the deadlines (a 2 Mbit/s link: a 1.2 MB load takes
   ~5 s, the deadline is 2 s): loads time out, the request recomputes; link down (every packet lost):
   lookups miss; healed: hits again.
4. the store full (hard-pinned filler objects take the whole segment): puts are refused and counted,
   nothing stalls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cluster import CLIENT_TTL_S, Cluster, prompt

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.vllm]

#: The connector's default ``breaker_reset_s`` is 5; wait a little longer before expecting the tier back.
BREAKER_WAIT_S = 5.5
#: No step may take longer than this. A cold request takes 1-4 s on an idle 2-core box (up to ~30 s on a
#: loaded one); a fault costs at most a 2 s deadline plus the 3 s lookup budget. A stall -- Mooncake's own
#: 30 s RPC timeout per call, or ~4.3 s per call against a dead master without the breaker -- exceeds it.
STEP_LIMIT_S = 60.0


def test_faults_across_the_wire_keep_tokens_identical(cluster: Cluster, tmp_path: Path) -> None:
    tokens = prompt(51)
    full_prompt = prompt(52)
    faults: list[tuple[str, Callable[[], None], list[int]]] = []

    def fault(name: str, tokens: list[int] = tokens) -> Callable[[Callable[[], None]], Callable[[], None]]:
        def register(inject: Callable[[], None]) -> Callable[[], None]:
            faults.append((name, inject, tokens))
            return inject

        return register

    netem = cluster.pair.has_netem()

    @fault("cold")
    def _cold() -> None:
        pass

    @fault("node killed")
    def _node_killed() -> None:
        cluster.kill_node()

    @fault("node replaced")
    def _node_replaced() -> None:
        time.sleep(CLIENT_TTL_S + 1.0)  # the master expires the dead node and its keys
        cluster.start_node()

    @fault("master killed")
    def _master_killed() -> None:
        cluster.kill_master()

    @fault("master restarted")
    def _master_restarted() -> None:
        cluster.start_master()
        cluster.wait_for_capacity(lambda capacity: capacity > 0)  # the node re-mounted by itself
        time.sleep(BREAKER_WAIT_S)

    @fault("tier back")
    def _tier_back() -> None:
        pass

    @fault("link shaped within deadlines")
    def _shaped_within() -> None:
        if netem:
            cluster.pair.netem(["delay", "20ms", "loss", "2%"])
        else:
            cluster.pair.shape(rate="100mbit", latency_ms=200)

    @fault("link shaped beyond deadlines")
    def _shaped_beyond() -> None:
        cluster.pair.heal()
        if netem:
            cluster.pair.netem(["delay", "1500ms", "loss", "30%"])
        else:
            cluster.pair.shape(rate="2mbit", latency_ms=2000)

    @fault("link down")
    def _link_down() -> None:
        cluster.pair.heal()
        time.sleep(BREAKER_WAIT_S)
        cluster.pair.partition()

    @fault("link healed")
    def _link_healed() -> None:
        cluster.pair.heal()
        time.sleep(BREAKER_WAIT_S)

    @fault("hit after heal")
    def _hit_after_heal() -> None:
        pass

    @fault("store full", tokens=full_prompt)
    def _store_full() -> None:
        assert cluster.fill_pool() > 0

    @fault("store full, reference", tokens=full_prompt)
    def _full_reference() -> None:
        pass

    steps = [
        {"prompt": step_tokens, "wait_for": str(tmp_path / f"go{i}"), "done": str(tmp_path / f"done{i}")}
        for i, (_name, _inject, step_tokens) in enumerate(faults)
    ]
    engine = cluster.start_engine(cluster.pair.b, "b-faults", steps, namespace="faults")
    for i, (name, inject, _tokens) in enumerate(faults):
        inject()
        (tmp_path / f"go{i}").write_text("")
        deadline = time.monotonic() + 600.0
        while not (tmp_path / f"done{i}").exists():
            assert engine.process.poll() is None, f"engine exited during step {i} ({name}); see {engine.log}"
            assert time.monotonic() < deadline, f"step {i} ({name}) did not finish"
            time.sleep(0.05)
    result = engine.result()
    by_name = dict(zip([name for name, _inject, _tokens in faults], result["steps"], strict=True))
    _check(by_name, netem)


def _delta(by_name: dict[str, Any], name: str, previous: str, side: str, counter: str) -> float:
    return float(by_name[name][side].get(counter, 0) - by_name[previous][side].get(counter, 0))


def _check(s: dict[str, Any], netem: bool) -> None:
    reference = s["cold"]["tokens"]
    for name, step in s.items():
        expected = s["store full, reference"]["tokens"] if name.startswith("store full") else reference
        assert step["tokens"] == expected, f"{name}: tokens differ"
        assert step["seconds"] < STEP_LIMIT_S, f"{name}: took {step['seconds']:.1f} s"
    report = {name: (step["cached"], round(step["seconds"], 2)) for name, step in s.items()}
    print("(cached tokens, seconds) per step:", report, "netem" if netem else "tbf")

    assert s["cold"]["cached"] == 0 and s["cold"]["worker"]["save_keys"] == 3
    # Node dead, keys still listed: the load fails, the request recomputes.
    assert s["node killed"]["cached"] == 0
    assert _delta(s, "node killed", "cold", "worker", "load_failed_keys") > 0
    assert _delta(s, "node killed", "cold", "sched", "truncations") > 0
    # New empty node: a miss, saved again.
    assert s["node replaced"]["cached"] == 0
    assert _delta(s, "node replaced", "node killed", "worker", "save_keys") == 3
    # Master dead: breaker open, misses; no load attempted.
    assert s["master killed"]["cached"] == 0
    assert s["master killed"]["store"]["breaker_opens"] >= 1
    assert _delta(s, "master killed", "node replaced", "worker", "load_keys") == 0
    # Restarted master: cold (its state is gone), saves work again, then hits.
    assert s["master restarted"]["cached"] == 0
    assert _delta(s, "master restarted", "master killed", "worker", "save_keys") == 3
    assert s["tier back"]["cached"] == 256
    # Link faults.
    assert s["link shaped within deadlines"]["cached"] == 256
    beyond = s["link shaped beyond deadlines"]
    assert beyond["cached"] < 256 or _delta(s, "link shaped beyond deadlines", "tier back", "worker",
                                            "load_failed_keys") > 0  # fmt: skip
    assert s["link down"]["cached"] == 0
    assert s["hit after heal"]["cached"] == 256, "the tier did not come back after the link healed"
    # Full store: refused puts are counted, the request is not held up.
    full_failed = _delta(s, "store full", "hit after heal", "worker", "save_failed_keys")
    full_drops = _delta(s, "store full", "hit after heal", "worker", "put_wave_drops")
    assert full_failed > 0 and full_drops > 0, "puts into a full store must be refused and counted"
