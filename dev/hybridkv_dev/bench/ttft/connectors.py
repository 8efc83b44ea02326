"""One connector's measurement each: hybridkv (file or Mooncake store), vLLM's ExampleConnector, vLLM's
MooncakeStoreConnector (in a child process)."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.connector.worker.load_probe import LoadProbe
from hybridkv.demo import vllm_harness
from hybridkv.ops import inprocess
from hybridkv.store.base import find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.file.probe import ReadProbe

from hybridkv_dev.bench.ttft.engine import RoundHooks, _load_profile_from_audit, engine_kwargs, ttft_rounds


def measure_hybridkv(
    model_dir: Path,
    *,
    store_url: str,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    audit_log: Path | None = None,
    warmup_tokens: int = 512,
    seed: int = 1000,
) -> dict[str, Any]:
    """Cold / local-hit / external-hit TTFT samples of one engine with ``HybridStoreConnector``; with
    ``audit_log``, also each counted external hit's lookup and load times from the connector's audit log."""
    extra: dict[str, Any] = {"store": store_url, "lookup_budget_ms": 5000}
    if audit_log is not None:
        extra["audit_log"] = str(audit_log)
    transfer = inprocess.connector_transfer_config(extra)
    loaded_bytes: list[int] = []
    loaded_keys: list[int] = []
    load_job_s: list[float] = []
    phases_ms: list[dict[str, float]] = []
    start = time.perf_counter()
    with inprocess.inprocess_engine(
        model_dir,
        prefix_caching=True,
        transfer=transfer,
        **engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    ) as llm:
        engine_start_s = time.perf_counter() - start
        sched, worker = inprocess.connector_halves(llm)
        # The worker's load phases: production times nothing, the bench hangs its probe in (deltas per hit).
        load_probe = LoadProbe()
        worker.worker_side.install_load_probe(load_probe)
        geo = sched.scheduler_side.geo.describe()
        totals = worker.worker_side.stats.totals
        before: dict[str, float] = {}
        phases_before: dict[str, float] = {}

        def before_external() -> None:
            before.update(
                (name, totals.get(name, 0)) for name in ("load_bytes", "load_keys", "load_job_seconds")
            )
            phases_before.clear()
            phases_before.update(_load_phase_seconds(load_probe, worker.worker_side.store))

        def after_external(counted: bool) -> None:
            # Read before the flush and settle below: their pump requests are no part of the hit.
            phases = _load_phase_seconds(load_probe, worker.worker_side.store)
            worker.worker_side.flush()
            vllm_harness.settle(llm)
            if counted:
                loaded_bytes.append(int(totals.get("load_bytes", 0) - before["load_bytes"]))
                loaded_keys.append(int(totals.get("load_keys", 0) - before["load_keys"]))
                load_job_s.append(float(totals.get("load_job_seconds", 0.0) - before["load_job_seconds"]))
                phases_ms.append(
                    {
                        # seconds -> ms per hit; counts (jobs, keys) stay counts
                        (f"{name[:-2]}_ms" if name.endswith("_s") else name): (
                            (value - phases_before.get(name, 0.0)) * (1e3 if name.endswith("_s") else 1)
                        )
                        for name, value in phases.items()
                    }
                )

        hooks = RoundHooks(
            after_cold=lambda _counted: vllm_harness.settle(llm),
            drop_local_cache=lambda: vllm_harness.drop_local_cache(llm),
            before_external=before_external,
            after_external=after_external,
        )
        samples, cached = ttft_rounds(
            llm, hooks, prompt_tokens=prompt_tokens, rounds=rounds, warmup_tokens=warmup_tokens, seed=seed
        )
        sched_totals = dict(sched.scheduler_side.stats.totals)
    # The engine is shut down: the audit log is closed. Its first load is the warm-up round's.
    load_profile = _load_profile_from_audit(audit_log)[1:] if audit_log is not None else []
    return {
        "load_profile": load_profile,
        "engine_start_s": engine_start_s,
        "geometry": geo,
        "samples_s": samples,
        "num_cached_tokens": cached,
        "loaded_bytes": loaded_bytes,
        "loaded_keys": loaded_keys,
        "load_job_s": load_job_s,
        "load_phases_ms": phases_ms,
        "torch_threads": num_torch_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "scheduler_totals": {k: v for k, v in sched_totals.items() if not k.startswith("hit_tokens.")},
    }


def _load_phase_seconds(probe: LoadProbe, store: Any) -> dict[str, float]:
    """The worker's load-phase totals (``probe``, installed in its worker: summed since then) and, on a file
    store, the store's own read-phase totals (prefixed ``file_``) from the ``ReadProbe`` this hangs into its
    ``FileBackend`` on the first call (production runs none): summed since then; seconds
    (``*jobs``/``*keys``: counts)."""
    out = {name: float(value) for name, value in probe.totals().items()}
    backend = find_layer(store, FileBackend)
    if backend is not None:
        read_probe = backend.read_probe
        if read_probe is None:
            read_probe = ReadProbe()
            backend.install_read_probe(read_probe)
        out |= {f"file_{name}": float(value) for name, value in read_probe.totals().items()}
    return out


def num_torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def measure_example_connector(
    model_dir: Path,
    *,
    storage_dir: Path,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    warmup_tokens: int = 512,
    seed: int = 2000,
) -> dict[str, Any]:
    """vLLM's ``ExampleConnector`` in its own engine: cold send, then the same prompt again (its hit)."""
    from vllm.config import KVTransferConfig

    storage_dir.mkdir(parents=True, exist_ok=True)
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(storage_dir)},
    )
    file_bytes: list[int] = []
    before: list[int] = []

    def after_cold(counted: bool) -> None:
        if counted:
            file_bytes.append(_dir_bytes(storage_dir) - before[-1])

    hooks = RoundHooks(before_cold=lambda: before.append(_dir_bytes(storage_dir)), after_cold=after_cold)
    with inprocess.inprocess_engine(
        model_dir,
        prefix_caching=False,
        transfer=transfer,
        **engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    ) as llm:
        samples, cached = ttft_rounds(
            llm, hooks, prompt_tokens=prompt_tokens, rounds=rounds, warmup_tokens=warmup_tokens, seed=seed
        )
    return {"samples_s": samples, "num_cached_tokens": cached, "file_bytes": file_bytes}


#: Blocks vLLM may keep pinned right after a request (saves in flight); a few engine steps release them.
_PUMP_TOKENS = [7] * 8


def _drop_local_cache_any_connector(llm: Any, attempts: int = 40) -> None:
    """``reset_prefix_cache()`` keeping the external tier, for any connector: vLLM refuses while saves still
    pin blocks, so step the engine with a short request between attempts."""
    from vllm import SamplingParams

    for _ in range(attempts):
        if llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
            return
        llm.generate(
            [{"prompt_token_ids": _PUMP_TOKENS}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
        )
        time.sleep(0.05)
    raise RuntimeError(f"vLLM refused to reset its prefix cache {attempts} times (blocks still in use)")


def _wait_until_no_block_in_use(llm: Any, attempts: int = 400) -> int:
    """Step the engine with a short request until no KV block is referenced (in-process engines only).

    ``MooncakeStoreConnector``'s in-flight save holds references on the blocks it reads until the scheduler
    learns it finished; waiting for that after the cold request makes the local hit a pure local prefix hit,
    with no store traffic of the cold request's save running beside it (the hybridkv engine's saves are
    flushed the same way). Returns the number of steps it took; ``RuntimeError`` after ``attempts``."""
    from vllm import SamplingParams

    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    for step in range(attempts):
        if pool.get_num_free_blocks() >= pool.num_gpu_blocks - 1:  # all but the null block
            return step
        llm.generate(
            [{"prompt_token_ids": _PUMP_TOKENS}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
        )
        time.sleep(0.01)
    raise RuntimeError(f"KV blocks still referenced after {attempts} engine steps (a save never finished)")


def _mooncake_store_connector_rounds(
    model_dir: Path,
    *,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    warmup_tokens: int,
    seed: int,
    torch_threads: int,
    cpus: list[int],
) -> dict[str, Any]:
    """Cold / local / external samples of vLLM's ``MooncakeStoreConnector`` (``MOONCAKE_CONFIG_PATH`` set by
    the caller); the same protocol as :func:`measure_hybridkv`, on the same cores (``cpus``) with the same
    number of torch threads as the hybridkv engines. Runs in a child process (see
    :func:`measure_mooncake_store_connector`)."""
    import torch
    from vllm.config import KVTransferConfig

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(torch_threads)  # before vLLM's CPU worker disables it
    inprocess.prepare_inprocess_environment("ERROR")
    transfer = KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_both")
    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
        **engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    )
    settle_steps: list[int] = []

    def after_cold(counted: bool) -> None:
        steps = _wait_until_no_block_in_use(llm)
        if counted:
            settle_steps.append(steps)

    # Its drop succeeds only once its saves have been reported (until then they pin the blocks): untimed.
    hooks = RoundHooks(after_cold=after_cold, drop_local_cache=lambda: _drop_local_cache_any_connector(llm))
    samples, cached = ttft_rounds(
        llm, hooks, prompt_tokens=prompt_tokens, rounds=rounds, warmup_tokens=warmup_tokens, seed=seed
    )
    return {
        "samples_s": samples,
        "num_cached_tokens": cached,
        "steps_until_saves_done": settle_steps,
        "torch_threads": num_torch_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def _mooncake_store_connector_child(kwargs: dict[str, Any], config_path: str, out_path: str) -> None:
    """Child process body: measure, write the JSON result, and exit hard (in-process, the engine's
    teardown hangs in ``zmq.Context.term``: its lookup server's socket is never closed)."""
    os.environ["MOONCAKE_CONFIG_PATH"] = config_path
    code = 0
    try:
        result = _mooncake_store_connector_rounds(**kwargs)
    except BaseException as error:  # noqa: BLE001 -- reported to the parent as text
        result = {"error": f"{type(error).__name__}: {error}"}
        code = 1
    Path(out_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def measure_mooncake_store_connector(
    model_dir: Path,
    *,
    master_address: str,
    segment_bytes: int,
    prompt_tokens: int,
    rounds: int,
    kv_cache_bytes: int,
    dtype: str,
    work_dir: Path,
    timeout_s: float = 1800.0,
    warmup_tokens: int = 512,
    seed: int = 3000,
) -> dict[str, Any]:
    """vLLM's in-tree ``MooncakeStoreConnector`` (embedded segment of ``segment_bytes`` in the engine, TCP,
    the bench's master) in its own spawned process; ``{"error": ...}`` when it fails or times out."""
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "mooncake_store_connector.json"
    config_path.write_text(
        json.dumps(
            {
                "mode": "embedded",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_address,
                "global_segment_size": segment_bytes,
                "local_buffer_size": 64 << 20,
                "protocol": "tcp",
                "device_name": "",
            }
        )
    )
    out_path = work_dir / "mooncake_store_connector.result.json"
    kwargs = {
        "model_dir": model_dir,
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "kv_cache_bytes": kv_cache_bytes,
        "dtype": dtype,
        "warmup_tokens": warmup_tokens,
        "seed": seed,
        # The same cores and thread count as the hybridkv engines of this (parent) process.
        "torch_threads": num_torch_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    process = multiprocessing.get_context("spawn").Process(
        target=_mooncake_store_connector_child,
        args=(kwargs, str(config_path), str(out_path)),
        name="hybridkv-bench-mooncake-store-connector",
    )
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(10)
        return {"error": f"MooncakeStoreConnector child did not finish within {timeout_s:.0f} s (killed)"}
    if not out_path.exists():
        return {"error": f"MooncakeStoreConnector child exited with {process.exitcode} and no result"}
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result
