"""Engines as separate processes sharing one ``file://`` store: reuse across engines, hygiene, teardown.

Each engine runs ``engine_script.py`` in its own Python process (vLLM's multiprocess mode needs a
``__main__`` guard, and a process that does not exit by itself is the teardown bug we look for: the in-tree
Mooncake connector hangs in ``zmq.Context.term``). Every run must exit with status 0 within
``EXIT_TIMEOUT_S``, and no ``hybridkv-*`` thread may be alive after ``del llm`` / the engine's shutdown.

- multiprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): engine 1 stores, exits; engine 2, a fresh process on
  the same store, takes the prompt's prefix from it (256 external tokens) with identical greedy tokens, and
  the connector's counters show up in the frontend's Prometheus registry (``LLM.get_metrics()``).
- in-process (``=0``): ``reset_prefix_cache()`` succeeds right after a request even while the request's
  saves are still being written (a store slowed by 200 ms per call); ``reset_prefix_cache(
  reset_connector=True)`` removes this namespace's entries only (another namespace's keys in the same
  store survive, this namespace's resend misses); ``get_external_cache_hit_sources`` reports ``disk``. The
  second engine starts while the first runs; its first request waits until the first exited.
- tensor parallel 2 (vLLM's ``mp`` executor): every rank saves its shard, a fresh TP 2 engine loads them all;
  when one rank's reads fail, the whole request is recomputed with the same tokens. Qwen3-Next (hybrid) and
  Llama (full attention, 4 KV heads), each in one engine process, its prefix cache dropped between the
  cold run, the external hit and the faulty resend.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODELS_DIR = DEFAULT_MODELS_DIR
SCRIPT = Path(__file__).with_name("engine_script.py")
EXIT_TIMEOUT_S = 240.0
PROMPT = [random.Random(3).randrange(3, 500) for _ in range(300)]  # 2 full 128-token blocks + a tail


def _model() -> str:
    from hybridkv.demo.tiny_models import build_tiny_model

    return str(build_tiny_model("qwen3_next", MODELS_DIR))


class EngineProcess:
    """One engine process, started at once; ``finish()`` waits for it and checks its exit. One the test did
    not finish (it failed first) is killed after the test (``kill_unfinished_engines``)."""

    started: ClassVar[list[EngineProcess]] = []

    def __init__(self, tmp_path: Path, name: str, *, multiprocess: bool, **spec: Any) -> None:
        self.name = name
        self.out = tmp_path / f"{name}.json"
        spec_path = tmp_path / f"{name}.spec.json"
        spec_path.write_text(json.dumps({"model": _model(), "prompt": PROMPT, "out": str(self.out), **spec}))
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        self.log_path = tmp_path / f"{name}.log"
        self.t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(spec_path)], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        EngineProcess.started.append(self)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def finish(self) -> dict[str, Any]:
        """Wait for the process; assert it exits by itself, cleanly, without connector threads left."""
        name, proc, log_path, t0 = self.name, self.proc, self.log_path, self.t0
        try:
            rc = proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"{name}: engine process did not exit within {EXIT_TIMEOUT_S} s") from None
        text = log_path.read_text(errors="replace")
        assert rc == 0, f"{name}: exit status {rc}\n{text[-3000:]}"
        res: dict[str, Any] = json.loads(self.out.read_text())
        res["wall_s"] = time.monotonic() - t0
        res["log"] = text
        leftover = [t for t in res["threads"] if t.startswith("hybridkv")]
        assert not leftover, f"{name}: connector threads alive after teardown: {leftover}"
        # Both halves ran their shutdown (worker: queued saves written, threads joined; scheduler: store closed).
        # vLLM's process manager gives the engine core 5 s to exit; the engine core first waits up to 5 s for its
        # worker process, whose interpreter exit takes 4-5 s on this CPU build (also before the connector ran any
        # thread). When vLLM force-kills the engine core for that, the scheduler half never gets to run: then
        # the worker half must have shut down before the kill.
        worker_done = text.find("role=worker")
        assert "hybridkv connector shut down" in text and worker_done >= 0, (
            f"{name}: worker half did not shut down"
        )
        if "role=scheduler" not in text:
            killed = text.find("force killing remaining process EngineCore")
            assert 0 <= worker_done < killed, (
                f"{name}: scheduler half did not shut down and vLLM did not kill it"
            )
        return res


@pytest.fixture(autouse=True)
def kill_unfinished_engines() -> Iterator[None]:
    yield
    while EngineProcess.started:
        EngineProcess.started.pop().kill()


def run_engine(tmp_path: Path, name: str, *, multiprocess: bool, **spec: Any) -> dict[str, Any]:
    """Run one engine process; assert it exits by itself, cleanly, without connector threads left."""
    return EngineProcess(tmp_path, name, multiprocess=multiprocess, **spec).finish()


def run_tp2_hit_then_failing_rank(
    tmp_path: Path, name: str, model: str, prompt: list[int], store: str, namespace: str
) -> dict[str, Any]:
    """One TP 2 engine process on ``store`` (a ``file://`` URL): the cold run; once its saves settled (the
    result's ``cold_keys``: the block entries of ``namespace`` then), vLLM's prefix cache dropped and the prompt sent again (the external hit),
    then dropped and sent once more while rank 1's reads fail (its view fails every ``get`` after the hit's:
    ``fail_after=1&fail_ops=get&fault_tp_rank=1``). The result's ``resends`` are (hit, faulty resend)."""
    return run_engine(
        tmp_path,
        name,
        multiprocess=True,
        teardown="shutdown",
        model=model,
        prompt=prompt,
        store=f"faulty+{store}?fail_after=1&fail_ops=get&fault_tp_rank=1",
        namespace=namespace,
        tensor_parallel_size=2,
        resends=2,
        keys_store=store,
        keys_prefix=f"hkv1/{namespace}/",
    )


def _keys(store: str, prefix: str) -> list[str]:
    """The block entries under ``prefix`` (each fingerprint's manifest is not one)."""
    from hybridkv.connector.identity import MANIFEST_NAME
    from hybridkv.store import open_store

    s = open_store(store)
    try:
        return sorted(k for k in s.iter_keys(prefix) if not k.endswith(f"/{MANIFEST_NAME}"))
    finally:
        s.close()


def test_two_multiprocess_engines_share_a_file_store(tmp_path: Path) -> None:
    store = f"file://{tmp_path}/store?capacity=256MiB"
    first = run_engine(tmp_path, "engine1", multiprocess=True, store=store, namespace="mp", teardown="del")
    assert first["cached"] == 0 and first["reset_ok"] is True
    assert first["metrics"]["vllm:hybridkv_save_keys"] == 3  # 2 attention blocks + 1 GDN boundary state
    assert first["metrics"]["vllm:hybridkv_save_bytes"] > 0
    assert _keys(f"file://{tmp_path}/store", "hkv1/mp/"), "engine 1 left nothing in the store"

    second = run_engine(
        tmp_path, "engine2", multiprocess=True, store=store, namespace="mp", teardown="shutdown"
    )
    assert second["tokens"] == first["tokens"], "tokens differ after an external hit in a new engine"
    assert second["cached"] == 256
    m = second["metrics"]
    assert m["vllm:external_prefix_cache_hits"] == 256
    assert m["vllm:prompt_tokens_cached_by_source{source=disk}"] == 256
    assert m["vllm:hybridkv_hit_tokens"] == 256
    # Per group: the 1 GDN state and the 2 attention blocks of the hit (vLLM lists the GDN group first).
    assert m["vllm:hybridkv_group_loaded_blocks{group=0}"] == 1
    assert m["vllm:hybridkv_group_loaded_blocks{group=1}"] == 2
    assert m["vllm:hybridkv_load_keys"] == 3 and m["vllm:hybridkv_load_bytes"] > 0
    assert m["vllm:hybridkv_truncations"] == 0 and m["vllm:hybridkv_breaker_open"] == 0
    print(
        f"engine1 {first['wall_s']:.1f}s (teardown {first['teardown_s']:.1f}s), "
        f"engine2 {second['wall_s']:.1f}s (teardown {second['teardown_s']:.1f}s), hybridkv metrics: "
        + json.dumps({k: v for k, v in m.items() if "hybridkv" in k or "external" in k})
    )


def test_in_process_reset_hygiene_and_namespaces(tmp_path: Path) -> None:
    root = tmp_path / "store"
    # Every store call sleeps 600 ms: the request's saves are still being written when it returns (at
    # 200 ms a busy host sometimes returned from generate() after they had finished; the reset then
    # proved nothing). Settling waits up to 10 s.
    slow = f"faulty+file://{root}?capacity=256MiB&delay_ms=600"
    other_run = EngineProcess(
        tmp_path,
        "other",
        multiprocess=False,
        store=slow,
        namespace="other",
        teardown="shutdown",
        max_tokens=1,
        lookup_budget_ms=5000,  # every store call is slow on purpose: a default budget would read it as dead
    )  # one output token: the request ends in the step that enqueued its saves
    # "mine" starts meanwhile; its first request waits until "other" has exited.
    other_exited = tmp_path / "other.exited"
    mine_run = EngineProcess(
        tmp_path, "mine", multiprocess=False, store=f"file://{root}?capacity=256MiB", namespace="mine",
        reset_connector=True, teardown="del", wait_for=str(other_exited),
    )  # fmt: skip
    other = other_run.finish()
    other_exited.write_text("")
    assert other["pending_before_reset"] is True, "the slow store should still be writing at reset time"
    assert other["reset_ok"] is True, "an idle engine's prefix cache reset failed (save pins kept)"
    assert other["hit_sources"] == {"disk": 256}
    assert len(other["tokens"]) == 1
    assert other["worker_totals"]["save_keys"] == 3
    assert other["metrics"]["vllm:hybridkv_lookups"] == 1  # stats reach vLLM's registry in-process too
    other_keys = _keys(f"file://{root}", "hkv1/other/")
    assert len(other_keys) == 3

    mine = mine_run.finish()
    assert mine["cached"] == 0 and mine["reset_ok"] is True and mine["reset_connector_ok"] is True
    # The reset removed this namespace's entries: the resend misses the store and recomputes...
    assert mine["cached_after_reset"] == 0 and mine["tokens_after_reset"] == mine["tokens"]
    assert mine["sched_totals"].get("hit_tokens", 0) == 0
    # Counters settled by the reset reach the registry with the next engine step (the resend here).
    assert mine["metrics"]["vllm:hybridkv_save_keys"] >= 3 and mine["metrics"]["vllm:hybridkv_lookups"] == 2
    # ...and left the other namespace's entries alone.
    assert _keys(f"file://{root}", "hkv1/other/") == other_keys
    assert len(_keys(f"file://{root}", "hkv1/mine/")) == 3  # stored again by the resend
    print(
        f"in-process: other {other['wall_s']:.1f}s (teardown {other['teardown_s']:.2f}s), "
        f"mine {mine['wall_s']:.1f}s (teardown {mine['teardown_s']:.2f}s)"
    )


def test_tensor_parallel_engine_saves_and_loads_every_ranks_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP 2 on a real engine (vLLM's ``mp`` executor, one worker process per rank) with a hybrid model
    (Qwen3-Next: full attention with 4 KV heads and gated delta net with 2 key heads, both split over the
    ranks; vLLM's block becomes 256 at TP 2), one engine process (a TP 2 start costs ~30 s here): the cold
    run stores every rank's shard of each entry (both KV cache groups);
    vLLM's prefix cache is dropped and the prompt sent again: the external hit covers the prompt's blocks
    and the greedy tokens equal the cold run's; dropped and sent once more, rank 1's reads fail (its view
    fails every ``get`` after the hit's: ``fail_after=1&fail_ops=get&fault_tp_rank=1``; rank 0 reads its
    shards fine): the whole request is recomputed, on both ranks, never half-loaded. (Cross-process reuse:
    ``test_two_multiprocess_engines_share_a_file_store``; Llama at TP 2: the next test.)"""
    from hybridkv.demo.tiny_models import build_tiny_model

    family, hit, namespace = "qwen3_next", 512, "tp"
    model = str(build_tiny_model(family, MODELS_DIR, linear_num_key_heads=2, linear_num_value_heads=4))
    store = f"file://{tmp_path}/store"
    prompt = [random.Random(5).randrange(3, 500) for _ in range(600)]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM-CPU binds one core per rank
    res = run_tp2_hit_then_failing_rank(tmp_path, "tp-engine", model, prompt, store, namespace)
    assert res["cached"] == 0
    # The cold run's entries: vLLM's block for this model follows the host's page sizes (256 or 128 tokens
    # here), so their number does too; the 512-token hit loads every one of them, on both ranks.
    cold_keys = res["cold_keys"]
    keys = _keys(store, f"hkv1/{namespace}/")
    # Every entry has both shards, and both groups have entries (the resends saved more states, at the
    # boundaries they reached).
    shards = {
        rank: {key.replace(f"/{rank}/", "/") for key in keys if f"/{rank}/" in key} for rank in ("tp0", "tp1")
    }
    assert shards["tp0"] == shards["tp1"] and 2 * len(shards["tp0"]) >= cold_keys, keys
    assert {key.split("/")[3] for key in keys} == {"g0", "g1"}, keys

    loaded, faulted = res["resends"]
    m = loaded["metrics"]
    assert loaded["reset_ok"] and loaded["cached"] == hit, (
        f"{family}: {loaded['cached']} external tokens at TP 2"
    )
    assert m["vllm:hybridkv_hit_tokens"] == hit
    assert m["vllm:hybridkv_load_keys"] == cold_keys and m.get("vllm:hybridkv_load_failed_keys", 0) == 0, m
    assert m.get("vllm:hybridkv_truncations", 0) == 0
    assert loaded["tokens"] == res["tokens"], f"{family}: tokens differ after a TP 2 external hit"

    f = faulted["metrics"]
    assert faulted["reset_ok"]
    assert f.get("vllm:hybridkv_truncations", 0) >= 1, f
    assert f.get("vllm:hybridkv_load_failed_keys", 0) > 0, f
    assert faulted["tokens"] == res["tokens"], f"{family}: tokens differ after one rank's load failed"
    groups = sorted({key.split("/")[3] for key in keys})
    print(
        f"qwen3_next tp 2: {res['wall_s']:.1f}s (start {res['start_s']:.1f}s), hit {loaded['cached']}, {groups}"
    )


def test_llama_tensor_parallel_loads_every_ranks_keys_and_one_failing_rank_recomputes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama at TP 2 on a real engine (vLLM's ``mp`` executor; 4 KV heads, 2 per rank; one full-attention
    group, block 128), one engine process (a TP 2 start costs ~30 s here): the cold run stores every
    rank's shard of the prompt's 4 blocks; vLLM's prefix cache is dropped and the prompt sent again: the
    external hit is the 4 blocks (512 tokens), each rank reads its own 4 keys, the greedy tokens are the
    cold run's; dropped and sent once more, rank 1's reads fail (its store view fails every ``get`` after
    its first, the hit's: ``fail_after=1&fail_ops=get&fault_tp_rank=1``; rank 0 reads fine): the whole
    request is recomputed, with the cold run's tokens again."""
    from hybridkv.demo.tiny_models import build_tiny_model

    blocks, hit, namespace = 4, 512, "tp-llama"
    model = str(build_tiny_model("llama", MODELS_DIR, num_key_value_heads=4))
    store = f"file://{tmp_path}/store"
    prompt = [random.Random(5).randrange(3, 500) for _ in range(600)]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vLLM-CPU binds one core per rank
    res = run_tp2_hit_then_failing_rank(tmp_path, "tp-llama", model, prompt, store, namespace)
    assert res["cached"] == 0 and res["cold_keys"] == 2 * blocks
    keys = _keys(store, f"hkv1/{namespace}/")
    per_rank = {rank: sum(1 for key in keys if f"/{rank}/" in key) for rank in ("tp0", "tp1")}
    assert per_rank == {"tp0": blocks, "tp1": blocks} and len(keys) == 2 * blocks, keys

    loaded, faulted = res["resends"]
    m = loaded["metrics"]
    assert loaded["reset_ok"] and loaded["cached"] == hit, f"external hit {loaded['cached']}, expected {hit}"
    assert m["vllm:hybridkv_hit_tokens"] == hit
    # Both ranks loaded: 4 keys each (a worker reads only keys of its own rank).
    assert m["vllm:hybridkv_load_keys"] == 2 * blocks and m.get("vllm:hybridkv_load_failed_keys", 0) == 0, m
    assert m.get("vllm:hybridkv_truncations", 0) == 0
    assert loaded["tokens"] == res["tokens"], "Llama: tokens differ after a TP 2 external hit"

    f = faulted["metrics"]
    assert faulted["reset_ok"]
    assert f["vllm:hybridkv_hit_tokens"] >= 2 * hit  # the store still answers the lookup
    assert f.get("vllm:hybridkv_truncations", 0) >= 1, f
    # Rank 1's 4 keys failed (at least once; a capped retry may fail again), rank 0's read fine.
    failed = f.get("vllm:hybridkv_load_failed_keys", 0)
    assert failed >= blocks and failed % blocks == 0, f
    assert faulted["tokens"] == res["tokens"], "Llama: tokens differ after one rank's load failed"
    print(
        f"llama tp 2: {res['wall_s']:.1f}s (start {res['start_s']:.1f}s), hit {loaded['cached']}, "
        f"fault run: {failed:.0f} failed keys, {f.get('vllm:hybridkv_truncations', 0):.0f} truncations"
    )
