"""One vLLM engine with HybridStoreConnector, run as its own process by the tests in this folder.

``python engine_script.py SPEC.json``; SPEC keys: ``model``, ``store``, ``namespace``, ``prompt`` (token
ids), ``out`` (result JSON path), ``teardown`` (``"del"``: ``del llm``; ``"shutdown"``: the engine core
client's ``shutdown()`` first), ``reset_connector`` (bool: after the first request, reset with
``reset_connector=True`` and send the prompt again), ``tensor_parallel_size`` (> 1: vLLM's ``mp``
executor, one worker process per rank), ``resends`` (a count: after the first request, wait until its
saves settled -- see ``_settle_saves``; the block entries then under ``keys_prefix`` of ``keys_store`` are
``cold_keys`` --, then that many times: reset vLLM's prefix cache (retried until it succeeds) and send the
prompt again; each resend's tokens, cached tokens and metrics go to ``resends``). Multiprocessing follows
``VLLM_ENABLE_V1_MULTIPROCESSING`` from the environment (the caller sets it). ``wait_for`` (a path): the
engine starts at once, its first request waits until that file exists (the caller starts the next engine
while the previous one still runs).

The result JSON is written after teardown and lists the threads still alive then; the process must then
exit by itself (the caller enforces a timeout).
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _metrics(llm: Any) -> dict[str, float]:
    """Counters and gauges of this process's Prometheus registry: ``name`` or ``name{label=value}`` for the
    ``group`` / ``source`` labels, summed over the rest."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not hasattr(m, "value"):
            continue
        extra = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k in ("group", "source"))
        key = f"{m.name}{{{extra}}}" if extra else m.name
        out[key] = out.get(key, 0) + float(m.value)
    return out


def _sched_connector(llm: Any) -> Any:
    """The scheduler-role connector of an in-process engine (no reference kept: ``del llm`` must free it)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _block_keys(url: str, prefix: str) -> list[str]:
    """The block entries under ``prefix`` of the store at ``url`` (each fingerprint's manifest is not one)."""
    from hybridkv.connector.identity import MANIFEST_NAME
    from hybridkv.store import open_store

    store = open_store(url)
    try:
        return [k for k in store.iter_keys(prefix) if not k.endswith(f"/{MANIFEST_NAME}")]
    finally:
        store.close()


def _settle_saves(llm: Any, url: str, prefix: str, timeout_s: float = 60.0) -> int:
    """Step the engine with a prompt shorter than a block (no save of its own; every step's output brings
    the connector's counters and gauges to this process) until the saves so far settled: no block pinned for
    a save, and the store holds as many block entries under ``prefix`` as the workers' saves wrote (summed
    over ranks). Returns that count. How many entries a prompt makes is vLLM's (its block size for a hybrid
    model follows the host's page sizes), so the callers compare against it instead of a fixed number."""
    from hybridkv.demo.vllm_harness import PUMP_PROMPT
    from vllm import SamplingParams

    deadline = time.monotonic() + timeout_s
    while True:
        llm.generate([{"prompt_token_ids": PUMP_PROMPT}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.2)
        metrics = _metrics(llm)
        saved = int(metrics.get("vllm:hybridkv_save_keys", 0))
        pinned = int(metrics.get("vllm:hybridkv_pinned_blocks", 0))
        stored = len(_block_keys(url, prefix))
        if saved > 0 and pinned == 0 and stored == saved:
            return stored
        assert time.monotonic() < deadline, (
            f"saves not settled after {timeout_s} s: {stored} block entries stored, {saved} saved, {pinned} pinned"
        )


def _wait_for_file(path: str, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.05)


def _reset_prefix_cache(llm: Any, timeout_s: float = 30.0) -> bool:
    """vLLM's prefix cache reset, retried while blocks are still pinned (saves in flight)."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    t0 = time.monotonic()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        **(
            {"tensor_parallel_size": spec["tensor_parallel_size"], "distributed_executor_backend": "mp"}
            if spec.get("tensor_parallel_size", 1) > 1
            else {}
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridStoreConnector",  # found through the hybridkv plugin entry point
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "store": spec["store"],
                "namespace": spec["namespace"],
                **({"lookup_budget_ms": spec["lookup_budget_ms"]} if "lookup_budget_ms" in spec else {}),
            },
        ),
    )
    res: dict[str, Any] = {"start_s": time.monotonic() - t0}
    if spec.get("wait_for"):  # started ahead of time: the first request waits for the caller's signal
        _wait_for_file(spec["wait_for"])
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 4), ignore_eos=True)

    def gen(llm: Any) -> tuple[list[int], int]:
        o = llm.generate([{"prompt_token_ids": spec["prompt"]}], sp, use_tqdm=False)[0]
        return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)

    res["tokens"], res["cached"] = gen(llm)
    if llm.llm_engine.engine_core.__class__.__name__ == "InprocClient":  # saves still in flight?
        res["pending_before_reset"] = _sched_connector(llm).has_pending_push_work()
    # Idle right after the request: the device prefix cache must be resettable at once.
    res["reset_ok"] = llm.reset_prefix_cache()
    if spec.get("reset_connector"):
        res["reset_connector_ok"] = llm.reset_prefix_cache(reset_connector=True)
        res["tokens_after_reset"], res["cached_after_reset"] = gen(llm)
    time.sleep(0.5)  # the last step's stats reach the frontend's registry with the next output
    res["metrics"] = {
        k: v
        for k, v in _metrics(llm).items()
        if k.startswith(
            ("vllm:hybridkv", "vllm:external_prefix", "vllm:prefix_cache", "vllm:prompt_tokens_cached_by")
        )
    }

    if spec.get("resends"):
        res["cold_keys"] = _settle_saves(llm, spec["keys_store"], spec["keys_prefix"])
        res["resends"] = []
        for _ in range(spec["resends"]):
            reset_ok = _reset_prefix_cache(llm)
            tokens, cached = gen(llm)
            time.sleep(0.5)  # as above: the step's stats reach the registry with the next output
            metrics = {k: v for k, v in _metrics(llm).items() if k.startswith("vllm:hybridkv")}
            res["resends"].append(
                {"reset_ok": reset_ok, "tokens": tokens, "cached": cached, "metrics": metrics}
            )

    res["in_process"] = llm.llm_engine.engine_core.__class__.__name__ == "InprocClient"
    if res["in_process"]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        hits = _sched_connector(llm).get_external_cache_hit_sources(None, 256)
        res["hit_sources"] = {k.value: v for k, v in hits.items()}
        res["sched_totals"] = dict(_sched_connector(llm).scheduler_side.stats.totals)
        res["worker_totals"] = dict(get_kv_transfer_group().worker_side.stats.totals)

    t1 = time.monotonic()
    if spec.get("teardown", "del") == "shutdown":
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    res["teardown_s"] = time.monotonic() - t1
    res["threads"] = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    Path(spec["out"]).write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
