"""Time to first token through a real in-process vLLM engine (``hybridkv bench ttft``), as pure functions
returning dicts.

One engine per family with ``HybridStoreConnector`` on a ``file://`` store (under ``/dev/shm`` when present).
Every round uses a fresh random prompt and times ``llm.generate`` of one request with ``max_tokens=1``
(wall clock, so scheduling, the connector's lookup, the load and the forward are all inside):

- ``cold``: the prompt was never seen (full prefill; the connector saves its blocks),
- ``local``: the same prompt again (vLLM's own device prefix cache hits),
- ``external``: the same prompt after ``llm.reset_prefix_cache()``, which drops the device prefix cache and
  keeps the store, so the prefix comes from this connector.

Saves run off the forward path; each timed request starts with the previous one's saves flushed (untimed),
so the measurements do not overlap a background write. A warm-up round (same steps, other prompt) is not
counted. Medians over rounds; the bytes the external hit loaded come from the worker's own ``load_bytes``
counter, and the copy floor divides them by a ``memcpy`` (``numpy.copyto``) of the same value size and count
measured in the same run.

Baselines, each its own engine on the same machine in the same run:

- ``baseline=True`` (non-hybrid families): vLLM's in-tree ``ExampleConnector`` (safetensors files per request,
  no HMA) on the same scratch filesystem, prefix caching off (as it requires), the same prompt sent twice: the
  second send is its external hit; its overhead uses the file-store engine's local hits.
- ``mooncake=True``: the bench starts a ``mooncake_master`` on 127.0.0.1 (so it must run in a loopback-only
  network namespace: ``scripts/netns-run hybridkv bench ttft --mooncake``) and adds hybridkv on ``mooncake://``
  and vLLM's in-tree ``MooncakeStoreConnector`` (embedded segment, TCP, non-hybrid families) with the same
  protocol. The latter runs in a spawned child that writes its samples and exits hard: in-process, its
  engine's teardown hangs in ``zmq.Context.term``.

Each row's overhead is the median over rounds of (external - local) of the same engine, with its [min, max];
it is divided by the memcpy floor (measured in this process) and by ``MooncakeStoreConnector``'s overhead.
The hit profile splits a hybridkv hit: lookup and load wall time from the connector's audit log
(``monotonic`` of ``lookup_started`` / ``hit_found`` / ``load_started`` / ``load_verified``), and the store's
own read, verify and a memcpy of the same bytes from a microbench in this process (``PROFILE_SOURCES``).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import platform
import random
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.bench.report import pyplot_or_none, save_figure, target_row
from hybridkv.bench.store import bench_scratch_dir, measure_memcpy, measure_put_get
from hybridkv.connector.worker.load_probe import LoadProbe
from hybridkv.devkit import vllm_harness
from hybridkv.devkit.mooncake import MooncakeMaster, running_master
from hybridkv.devkit.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model, tiny_config_kwargs
from hybridkv.ops import inprocess
from hybridkv.store.base import find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.file.probe import ReadProbe
from hybridkv.store.frame import compute_checksum, default_checksum
from hybridkv.store.url import open_store

__all__ = [
    "DEFAULT_FAMILIES",
    "PEER_CONNECTOR",
    "PROFILE_COLUMNS",
    "PROFILE_SOURCES",
    "TABLE_COLUMNS",
    "default_scratch_dir",
    "measure_mooncake_store_connector",
    "measure_store_path",
    "plot_report",
    "run_ttft_bench",
]

#: The columns ``hybridkv bench`` prints, in order.
TABLE_COLUMNS = [
    "family",
    "connector",
    "cold_ms",
    "local_hit_ms",
    "external_hit_ms",
    "external_hit_tokens",
    "loaded_mb",
    "overhead_ms",
    "overhead_ms_spread",
    "copy_floor_ms",
    "overhead_over_floor",
    "overhead_over_peer",
    "loadavg_1m",
]

DEFAULT_FAMILIES = ("llama", "lfm2")
#: Families vLLM's ExampleConnector can serve (it does not support the hybrid KV-cache manager).
_EXAMPLE_FAMILIES = ("llama",)


def default_scratch_dir(parent: str | None = None) -> Any:
    """A temp dir under ``parent`` (default: ``/dev/shm`` when present) as a context manager; the stores live
    there."""
    return bench_scratch_dir(parent)


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def _engine_kwargs(prompt_tokens: int, kv_cache_bytes: int, dtype: str) -> dict[str, Any]:
    return inprocess.engine_kwargs(
        max_model_len=max(2048, prompt_tokens + 64), kv_cache_bytes=kv_cache_bytes, dtype=dtype
    )


def _timed_generate(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Seconds of one ``llm.generate`` (``max_tokens=1``) and the request's ``num_cached_tokens``."""
    start = time.perf_counter()
    out = vllm_harness.greedy(llm, tokens, max_tokens=1)
    elapsed = time.perf_counter() - start
    return elapsed, int(out.num_cached_tokens or 0)


def _nothing() -> None:
    pass


def _nothing_counted(_counted: bool) -> None:
    pass


@dataclass(frozen=True)
class _RoundHooks:
    """What one connector's engine does around the timed requests of a round (all untimed). ``counted`` is
    False in the warm-up round."""

    before_cold: Callable[[], None] = _nothing
    after_cold: Callable[[bool], None] = _nothing_counted
    #: Drop vLLM's local prefix cache and keep the external tier; None: no local-hit request (prefix
    #: caching off, so the second send is the external hit).
    drop_local_cache: Callable[[], None] | None = None
    before_external: Callable[[], None] = _nothing
    after_external: Callable[[bool], None] = _nothing_counted


def _ttft_rounds(
    llm: Any, hooks: _RoundHooks, *, prompt_tokens: int, rounds: int, warmup_tokens: int, seed: int
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """The protocol every connector runs: per round a fresh prompt, cold; again (local hit); again after
    ``hooks.drop_local_cache`` (external hit). Round 0 warms every code path on a prompt of at most
    ``warmup_tokens`` and is not counted. Returns (seconds, num_cached_tokens) per request kind."""
    kinds = ("cold", "external") if hooks.drop_local_cache is None else ("cold", "local", "external")
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    cached: dict[str, list[int]] = {kind: [] for kind in kinds}
    for round_index in range(rounds + 1):
        counted = round_index > 0
        n = prompt_tokens if counted else min(prompt_tokens, warmup_tokens)
        tokens = _prompt(n, seed + round_index)
        timed: dict[str, tuple[float, int]] = {}
        hooks.before_cold()
        timed["cold"] = _timed_generate(llm, tokens)
        hooks.after_cold(counted)
        if hooks.drop_local_cache is not None:
            timed["local"] = _timed_generate(llm, tokens)
            hooks.drop_local_cache()
        hooks.before_external()
        timed["external"] = _timed_generate(llm, tokens)
        hooks.after_external(counted)
        if counted:
            for kind, (seconds, num_cached) in timed.items():
                samples[kind].append(seconds)
                cached[kind].append(num_cached)
    return samples, cached


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); without them bf16 matmuls on
    CPU run far slower than float32 (measured here: a 4000x1024x2816 matmul took 26 s in bf16, 0.17 s in fp32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """``auto`` -> ``bfloat16`` on CPUs with fast bf16, else ``float32``; anything else unchanged."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def _mooncake_master(log_dir: Path) -> contextlib.AbstractContextManager[MooncakeMaster]:
    """A ``mooncake_master`` child on 127.0.0.1 for the bench's lifetime (the product's argv and lease).

    ``RuntimeError`` outside a loopback-only namespace (``scripts/netns-run``) or without the binary."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    return running_master(log_dir / "mooncake_master.log")


def _load_profile_from_audit(path: Path) -> list[dict[str, float]]:
    """Per external hit (in request order), from the connector's audit log (scheduler-side transitions,
    ``monotonic`` seconds): ``lookup_ms`` = lookup_started -> hit_found, ``load_ms`` = load_started ->
    load_verified (the scheduler's view of the load: issue, the worker's read + verify + copy into the pages,
    and the engine steps until the scheduler saw it finished)."""
    by_request: dict[str, dict[str, float]] = {}
    order: list[str] = []
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        request_id, event = record.get("request_id"), record.get("event")
        if not isinstance(request_id, str) or not isinstance(record.get("monotonic"), (int, float)):
            continue
        times = by_request.setdefault(request_id, {})
        if event not in times:  # the first of each event (a retry would start a second lookup)
            times[str(event)] = float(record["monotonic"])
        if event == "load_verified":
            order.append(request_id)
    profiles = []
    for request_id in order:
        times = by_request[request_id]
        profiles.append(
            {
                "lookup_ms": (times.get("hit_found", math.nan) - times.get("lookup_started", math.nan)) * 1e3,
                "load_ms": (times["load_verified"] - times.get("load_started", math.nan)) * 1e3,
            }
        )
    return profiles


def _median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def measure_store_path(
    store_url: str, value_size: int, num_values: int, *, repeats: int = 5
) -> dict[str, Any]:
    """The store's own costs for one hit's bytes, in this process (ms, medians of ``repeats``): the whole
    framed ``get_into`` (checksum or keyed hash on), the same with ``checksum=none`` (read + copy alone), the checksum of
    those bytes alone, and one ``memcpy`` of them. The difference of the first two is the verify cost."""
    # The read alone: no checksum, and no keyed hash (a keyed store refuses checksum=none).
    base, _, query = store_url.partition("?")
    params = [p for p in query.split("&") if p and not p.startswith("integrity_key_")]
    unchecked = f"{base}?{'&'.join([*params, 'checksum=none'])}"
    out: dict[str, Any] = {}
    for name, url in (("get_ms", store_url), ("get_no_checksum_ms", unchecked)):
        store = open_store(url)
        try:
            samples = []
            for _ in range(max(1, repeats)):
                gbps = measure_put_get(store, value_size, num_values, repeats=1)["get_gbps"]
                samples.append(value_size * num_values / gbps / 1e9)
            out[name] = _median_ms(samples)
        finally:
            store.close()
    algo = default_checksum()
    buffers = [memoryview(os.urandom(value_size)) for _ in range(num_values)]
    checksum_s = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for buffer in buffers:
            compute_checksum(algo, [buffer])
        checksum_s.append(time.perf_counter() - start)
    out["checksum_ms"] = _median_ms(checksum_s)
    out["checksum_algo"] = algo.url_name
    memcpy_s = [
        value_size * num_values / measure_memcpy(value_size, num_values, repeats=1)["memcpy_gbps"] / 1e9
        for _ in range(max(1, repeats))
    ]
    out["memcpy_ms"] = _median_ms(memcpy_s)
    return out


def _model_facts(family: str, size: str, dtype: str) -> dict[str, Any]:
    _, kw = tiny_config_kwargs(family, size=size)
    layer_types = kw.get("layer_types") or ["full_attention"] * kw["num_hidden_layers"]
    num_full = sum(1 for t in layer_types if t == "full_attention")
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    return {
        "hidden_size": kw["hidden_size"],
        "num_layers": kw["num_hidden_layers"],
        "layer_types": sorted(set(layer_types)),
        "num_full_attention_layers": num_full,
        "kv_heads": kw["num_key_value_heads"],
        "head_dim": head_dim,
        # K and V of every full-attention layer
        "kv_bytes_per_token_full_attention": num_full * 2 * kw["num_key_value_heads"] * head_dim * itemsize,
    }


def _num_params(model_dir: Path) -> int | None:
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover -- vLLM depends on safetensors
        return None
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 -- safe_open is not a mapping
                total += math.prod(int(n) for n in handle.get_slice(name).get_shape())
    return total


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
        **_engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
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

        hooks = _RoundHooks(
            after_cold=lambda _counted: vllm_harness.settle(llm),
            drop_local_cache=lambda: vllm_harness.drop_local_cache(llm),
            before_external=before_external,
            after_external=after_external,
        )
        samples, cached = _ttft_rounds(
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
        "torch_threads": _torch_threads(),
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


def _torch_threads() -> int:
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

    hooks = _RoundHooks(before_cold=lambda: before.append(_dir_bytes(storage_dir)), after_cold=after_cold)
    with inprocess.inprocess_engine(
        model_dir,
        prefix_caching=False,
        transfer=transfer,
        **_engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    ) as llm:
        samples, cached = _ttft_rounds(
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
        **_engine_kwargs(prompt_tokens, kv_cache_bytes, dtype),
    )
    settle_steps: list[int] = []

    def after_cold(counted: bool) -> None:
        steps = _wait_until_no_block_in_use(llm)
        if counted:
            settle_steps.append(steps)

    # Its drop succeeds only once its saves have been reported (until then they pin the blocks): untimed.
    hooks = _RoundHooks(after_cold=after_cold, drop_local_cache=lambda: _drop_local_cache_any_connector(llm))
    samples, cached = _ttft_rounds(
        llm, hooks, prompt_tokens=prompt_tokens, rounds=rounds, warmup_tokens=warmup_tokens, seed=seed
    )
    return {
        "samples_s": samples,
        "num_cached_tokens": cached,
        "steps_until_saves_done": settle_steps,
        "torch_threads": _torch_threads(),
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
        "torch_threads": _torch_threads(),
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


def _load_change(at_start: float) -> str:
    """The host's 1-minute load average at a measurement's start and now, as ``start->end``: on a shared
    host other jobs' load inflates both hits of a round (the overhead is their difference, per round)."""
    return f"{at_start:.1f}->{os.getloadavg()[0]:.1f}"


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def _spread(values: Sequence[float]) -> list[float] | None:
    """[min, max] of the samples (the spread the medians hide)."""
    return [min(values), max(values)] if values else None


def _row(
    family: str,
    connector: str,
    *,
    samples_s: dict[str, list[float]],
    ext_tokens: int,
    loaded_bytes: int,
    loaded_keys: int | None,
    memcpy_gbps: float | None,
    local_s: list[float] | None = None,
    load_job: float | None = None,
) -> dict[str, Any]:
    """One table row. ``local_s`` overrides the local-hit samples (a connector measured without a local hit
    borrows the hybridkv engine's). The overhead is the median over rounds of (external - local), each round
    on its own prompt; its spread is [min, max] over rounds."""
    local_samples = samples_s.get("local") or local_s or []
    ext_samples = samples_s.get("external", [])
    cold, local, ext = (_median(samples_s.get("cold", [])), _median(local_samples), _median(ext_samples))
    overheads_ms = [(e - lo) * 1e3 for e, lo in zip(ext_samples, local_samples, strict=False)]
    floor_ms = loaded_bytes / memcpy_gbps / 1e6 if memcpy_gbps and loaded_bytes else None
    overhead_ms = _median(overheads_ms)
    return {
        "family": family,
        "connector": connector,
        "cold_ms": _ms(cold),
        "local_hit_ms": _ms(local),
        "external_hit_ms": _ms(ext),
        "external_hit_ms_spread": [v * 1e3 for v in _spread(ext_samples) or []] or None,
        "external_hit_tokens": ext_tokens,
        "loaded_bytes": loaded_bytes,
        "loaded_mb": loaded_bytes / 1e6,
        "loaded_keys": loaded_keys,
        "load_job_ms": _ms(load_job),
        "memcpy_gbps": memcpy_gbps,
        "copy_floor_ms": floor_ms,
        "external_over_local": _ratio(ext, local),
        "cold_over_external": _ratio(cold, ext),
        "overhead_ms": overhead_ms,
        "overhead_ms_spread": _spread(overheads_ms),
        "overhead_over_floor": _ratio(overhead_ms, floor_ms),
        "overhead_over_floor_spread": (
            [v / floor_ms for v in _spread(overheads_ms) or []] or None if floor_ms else None
        ),
        "overhead_over_peer": None,  # filled once the MooncakeStoreConnector row exists
    }


#: The rows' peer for ``overhead_over_peer``.
PEER_CONNECTOR = "MooncakeStoreConnector (vLLM)"


def _profile(
    overhead_ms: float | None,
    load_profile: Sequence[dict[str, float]],
    store_path: dict[str, Any] | None,
    load_job: float | None,
    phases_ms: Sequence[dict[str, float]] = (),
) -> dict[str, Any]:
    """Where a hybridkv hit's time above the local hit goes (ms, medians over rounds); see
    ``PROFILE_SOURCES``."""
    lookup_ms = _median([p["lookup_ms"] for p in load_profile if not math.isnan(p["lookup_ms"])])
    load_ms = _median([p["load_ms"] for p in load_profile if not math.isnan(p["load_ms"])])

    def phase(name: str) -> float | None:
        return _median([p[name] for p in phases_ms if name in p])

    out: dict[str, Any] = {
        "overhead_ms": overhead_ms,
        "lookup_ms": lookup_ms,
        "load_ms": load_ms,
        "load_job_ms": _ms(load_job),
        "queue_ms": phase("queue_ms"),
        "store_ms": phase("store_ms"),
        "open_ms": phase("file_open_ms"),
        "readv_ms": phase("file_read_ms"),
        "verify_ms": phase("file_verify_ms"),
        "close_ms": phase("file_close_ms"),
        "keys_read": phase("file_keys"),
        "report_ms": phase("report_ms"),
        "engine_steps": phase("engine_steps"),
        "engine_busy_ms": phase("engine_busy_ms"),
    }
    targets, commit = phase("targets_ms"), phase("commit_ms")
    out["targets_commit_ms"] = targets + commit if targets is not None and commit is not None else None
    if store_path is not None:
        out |= {
            "microbench_get_ms": store_path["get_ms"],
            "microbench_get_no_checksum_ms": store_path["get_no_checksum_ms"],
            "checksum_alone_ms": store_path["checksum_ms"],
            "memcpy_ms": store_path["memcpy_ms"],
        }
    steps = [out["queue_ms"], out["load_job_ms"], out["report_ms"]]
    if load_ms is not None and all(v is not None for v in steps):
        out["engine_wait_ms"] = load_ms - sum(v for v in steps if v is not None)
    if overhead_ms is not None and load_ms is not None:
        out["outside_load_ms"] = overhead_ms - load_ms - (lookup_ms or 0.0)
    return out


#: Where each number of the hit profile comes from.
PROFILE_SOURCES = {
    "overhead_ms": "TTFT external - local, median over rounds (llm.generate wall time)",
    "lookup_ms": "audit log: lookup_started -> hit_found (monotonic), scheduler side",
    "load_ms": "audit log: load_started -> load_verified, scheduler side: the hand-off to the worker, its "
    "load job, and the engine steps until the scheduler saw it finished",
    "load_job_ms": "worker's load thread, wall time of its load jobs during the request (load_job_seconds)",
    "queue_ms": "worker: start_load_kv -> the load thread takes the job (the worker's LoadProbe)",
    "store_ms": "worker: wall time inside the store's get_into (read + verify, all reader threads)",
    "open_ms": "file store: open + shared lock + name check, summed over keys and reader threads "
    "(the ReadProbe the bench hangs into its FileBackend; thread time, so with several readers it can "
    "exceed store_ms)",
    "readv_ms": "file store: readv of the frames straight into the KV pages, summed over reader threads",
    "verify_ms": "file store: the frame check (xxh3 over the bytes just read), summed over reader threads",
    "close_ms": "file store: mtime touch + close, summed over reader threads",
    "keys_read": "file store: keys read during the hit",
    "targets_commit_ms": "worker: building the destination views + committing them (host pages: no copy)",
    "report_ms": "worker: load job done -> the engine thread takes it in transfer_results",
    "engine_steps": "worker: engine steps (transfer_results calls) while the load was in flight",
    "engine_busy_ms": "worker: the engine thread's time between those calls (its own step work, holding the "
    "GIL the reader threads need after each system call)",
    "engine_wait_ms": "load_ms - queue - load_job - report: the scheduler -> worker hand-off (the step that "
    "issues the load) and the step after the report until the scheduler saw it",
    "outside_load_ms": "overhead - lookup - load: scheduling around the load (the extra steps of an async load)",
    "microbench_get_ms": "microbench, this process: framed get_into of the same bytes into host buffers",
    "microbench_get_no_checksum_ms": "microbench: the same with checksum=none (read alone)",
    "checksum_alone_ms": "microbench: the checksum over the same bytes, no store",
    "memcpy_ms": "microbench: np.copyto of the same bytes (the copy floor)",
}

#: The hit-profile columns ``hybridkv bench ttft`` prints.
PROFILE_COLUMNS = [
    "family",
    "connector",
    "overhead_ms",
    "lookup_ms",
    "load_ms",
    "queue_ms",
    "load_job_ms",
    "store_ms",
    "open_ms",
    "readv_ms",
    "verify_ms",
    "targets_commit_ms",
    "report_ms",
    "engine_steps",
    "engine_busy_ms",
    "engine_wait_ms",
    "outside_load_ms",
    "memcpy_ms",
]


#: The issue's targets for an external hit: its overhead above a local hit at most this many copy floors,
#: and at most this fraction of vLLM's ``MooncakeStoreConnector``'s overhead in the same run.
FLOOR_RATIO_TARGET = 2.0
PEER_RATIO_TARGET = 0.4


def ttft_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per hybridkv row: ``overhead_over_floor`` and ``overhead_over_peer`` against their targets (a missing
    ratio -- no peer in the run, or noise larger than the peer's hit -- is not met)."""
    out = []
    for row in rows:
        if not row["connector"].startswith("HybridStoreConnector"):
            continue
        name = f"{row['family']}: {row['connector']}"
        out.append(
            target_row(f"{name}: overhead / copy floor", row["overhead_over_floor"], "<=", FLOOR_RATIO_TARGET)
        )
        out.append(
            target_row(
                f"{name}: overhead / {PEER_CONNECTOR}'s overhead",
                row["overhead_over_peer"],
                "<=",
                PEER_RATIO_TARGET,
            )
        )
    return out


def run_ttft_bench(
    families: Sequence[str] = DEFAULT_FAMILIES,
    *,
    scratch_dir: str | os.PathLike[str],
    prompt_tokens: int = 4000,
    rounds: int = 3,
    size: str = "bench",
    dtype: str = "auto",
    baseline: bool = True,
    mooncake: bool = False,
    models_dir: Path = DEFAULT_MODELS_DIR,
    kv_cache_bytes: int | None = None,
    reserved_cpus: int = 1,
    keyed: bool = False,
) -> dict[str, Any]:
    """Measure every family; one row per (family, connector) with medians and same-run ratios.

    ``keyed``: also hybridkv on a ``file://`` store in keyed-integrity mode (``integrity_key_file``, a fresh
    secret in the scratch directory; ``hybridkv.store.integrity``), to price the mode next to the plain row.

    Every engine (the in-process ones and ``MooncakeStoreConnector``'s child) computes on this process's
    cores with ``max(1, cores - reserved_cpus)`` torch threads, like ``bench serve``'s ``--reserved-cpus``:
    the reserved core is left to the connectors' own threads and to other jobs on a shared host, where
    an OpenMP barrier across every core stalls whenever another process takes one of them.

    ``mooncake``: also hybridkv on ``mooncake://`` and vLLM's ``MooncakeStoreConnector`` (own process),
    against a ``mooncake_master`` the bench starts; needs a loopback-only network namespace
    (``scripts/netns-run``), else ``RuntimeError``."""
    # One process, so the connector's worker half is reachable; vLLM logs to stdout: keep the table readable.
    inprocess.prepare_inprocess_environment("ERROR")
    if rounds < 1 or prompt_tokens < 1:
        raise ValueError("need rounds >= 1 and prompt_tokens >= 1")
    resolved_dtype = resolve_dtype(dtype)
    compute_threads = _set_compute_threads(reserved_cpus)
    scratch = Path(scratch_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(_mooncake_master(scratch / "mooncake")).address if mooncake else None
        rows, details, profiles, not_measured = _measure_families(
            families,
            scratch=scratch,
            master_address=master,
            prompt_tokens=prompt_tokens,
            rounds=rounds,
            size=size,
            dtype=resolved_dtype,
            baseline=baseline,
            models_dir=models_dir,
            kv_cache_bytes=kv_cache_bytes,
            keyed=keyed,
        )
    if not mooncake:
        not_measured.append("Mooncake rows: not run (pass --mooncake, under scripts/netns-run)")
    return {
        "benchmark": "ttft",
        "unit": "ms of wall time of llm.generate(max_tokens=1) for one request; medians over rounds",
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "size": size,
        "dtype": resolved_dtype,
        "dtype_requested": dtype,
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "reserved_cpus": reserved_cpus,
        "compute_threads": compute_threads,
        "protocol": "per round a fresh prompt: cold; the same prompt again (local hit); reset_prefix_cache() "
        "(keeps the store) then the same prompt (external hit). Saves are flushed between requests, untimed. "
        "One warm-up round on a short prompt is not counted. MooncakeStoreConnector runs the same protocol "
        "in its own spawned process (its in-process teardown hangs), against the same mooncake_master, on "
        "the same cores with the same torch threads; after its cold request the engine steps until no KV "
        "block is referenced (its save finished), so its local hit runs with no store traffic beside it.",
        "ratios": "overhead_ms = median over rounds of (external-hit - local-hit) of the same engine; "
        "copy_floor_ms = loaded bytes / memcpy GB/s of the same value size, measured in this process; "
        "overhead_over_floor = overhead / copy floor; overhead_over_peer = overhead / the same family's "
        "MooncakeStoreConnector overhead; *_spread = [min, max] over rounds. ExampleConnector runs with "
        "prefix caching off (its loaded_bytes = safetensors bytes it wrote), so its overhead uses the "
        "file-store engine's local hits.",
        "rows": rows,
        "targets": ttft_targets(rows),
        "profiles": profiles,
        "profile_sources": PROFILE_SOURCES,
        "details": details,
        "not_measured": not_measured,
        "seconds": time.perf_counter() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def _set_compute_threads(reserved_cpus: int) -> int:
    """Give this process's engines ``max(1, cores - reserved_cpus)`` torch threads (the peer child copies
    this process's count); returns the count in effect. vLLM's CPU worker disables
    ``torch.set_num_threads`` once an engine has started in this process: the count then stays what it was
    (the report records it)."""
    import torch

    if reserved_cpus < 0:
        raise ValueError(f"reserved_cpus must be >= 0, got {reserved_cpus}")
    wanted = max(1, len(os.sched_getaffinity(0)) - reserved_cpus)
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return _torch_threads()


#: The row of ``keyed``: the file store in keyed-integrity mode.
KEYED_LABEL = "HybridStoreConnector file:// keyed"


def _integrity_key_file(scratch: Path) -> Path:
    """A key file with one fresh secret, readable by its owner only (the store warns otherwise)."""
    path = scratch / "integrity.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def _hybridkv_stores(
    family: str, scratch: Path, capacity: int, master_address: str | None, *, keyed: bool
) -> list[tuple[str, str]]:
    """(row label, store URL) of each hybridkv row of ``family``: the file store, keyed too with ``keyed``,
    and Mooncake with a master."""
    stores = [("HybridStoreConnector file://", f"file://{scratch}/store-{family}?capacity={capacity}")]
    if keyed:
        key_file = _integrity_key_file(scratch)
        stores.append(
            (
                KEYED_LABEL,
                f"file://{scratch}/store-{family}-keyed?capacity={capacity}&integrity_key_file={key_file}",
            )
        )
    if master_address is not None:
        stores.append(
            (
                "HybridStoreConnector mooncake://",
                f"mooncake://{master_address}?segment={capacity}&local_buffer=16MiB",
            )
        )
    return stores


def _measure_families(
    families: Sequence[str],
    *,
    scratch: Path,
    master_address: str | None,
    prompt_tokens: int,
    rounds: int,
    size: str,
    dtype: str,
    baseline: bool,
    models_dir: Path,
    kv_cache_bytes: int | None,
    keyed: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    profiles: list[dict[str, Any]] = []
    not_measured: list[str] = []
    for family in families:
        model_dir = build_tiny_model(family, models_dir, size=size)
        facts = _model_facts(family, size, dtype)
        per_prompt = prompt_tokens * max(1, facts["kv_bytes_per_token_full_attention"])
        # Room for a few prompts in vLLM's cache (hybrids: the state groups take as much again).
        kv_bytes = kv_cache_bytes or max(64 << 20, 6 * per_prompt)
        capacity = max(256 << 20, 4 * (rounds + 1) * per_prompt)
        stores = _hybridkv_stores(family, scratch, capacity, master_address, keyed=keyed)
        family_rows: list[dict[str, Any]] = []
        memcpy_gbps: float | None = None
        first_local: list[float] = []
        for label, url in stores:
            audit = scratch / f"audit-{family}-{len(family_rows)}.jsonl"
            load_at_start = os.getloadavg()[0]
            ours = measure_hybridkv(
                model_dir,
                store_url=url,
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
                audit_log=audit,
            )
            med_bytes = int(statistics.median(ours["loaded_bytes"]))
            med_keys = int(statistics.median(ours["loaded_keys"]))
            store_path = None
            if med_bytes > 0 and med_keys > 0:
                value_size = max(1, med_bytes // med_keys)
                # The same bytes in the same value size as the load, measured now (same machine load).
                gbps = measure_memcpy(value_size, med_keys, repeats=5)["memcpy_gbps"]
                memcpy_gbps = memcpy_gbps or gbps
                path_url = url.replace(f"store-{family}", f"store-{family}-microbench")
                store_path = measure_store_path(path_url, value_size, med_keys)
            row = _row(
                family,
                label,
                samples_s=ours["samples_s"],
                ext_tokens=int(statistics.median(ours["num_cached_tokens"]["external"])),
                loaded_bytes=med_bytes,
                loaded_keys=med_keys,
                memcpy_gbps=memcpy_gbps,
                load_job=_median(ours["load_job_s"]),
            ) | {"loadavg_1m": _load_change(load_at_start)}
            family_rows.append(row)
            first_local = first_local or ours["samples_s"]["local"]
            profiles.append(
                {"family": family, "connector": label}
                | _profile(
                    row["overhead_ms"],
                    ours["load_profile"],
                    store_path,
                    _median(ours["load_job_s"]),
                    ours["load_phases_ms"],
                )
            )
            details[f"{family}/{label}"] = {
                "model": str(model_dir),
                "model_facts": facts,
                "params": _num_params(model_dir),
                "kv_cache_memory_bytes": kv_bytes,
                "store_path": store_path,
                **ours,
            }
        peer_ok = master_address is not None and family in _EXAMPLE_FAMILIES
        if master_address is not None and not peer_ok:
            not_measured.append(
                f"{family}: MooncakeStoreConnector not run (hybrids need mamba_cache_mode=align there)"
            )
        if peer_ok:
            assert master_address is not None
            load_at_start = os.getloadavg()[0]
            peer = measure_mooncake_store_connector(
                model_dir,
                master_address=master_address,
                segment_bytes=capacity,
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
                work_dir=scratch / f"peer-{family}",
            )
            details[f"{family}/{PEER_CONNECTOR}"] = peer
            if "error" in peer:
                not_measured.append(f"{family}: {PEER_CONNECTOR} failed: {peer['error']}")
            else:
                tokens = int(statistics.median(peer["num_cached_tokens"]["external"]))
                family_rows.append(
                    _row(
                        family,
                        PEER_CONNECTOR,
                        samples_s=peer["samples_s"],
                        ext_tokens=tokens,
                        loaded_bytes=tokens * facts["kv_bytes_per_token_full_attention"],
                        loaded_keys=None,
                        memcpy_gbps=memcpy_gbps,
                    )
                    | {"loadavg_1m": _load_change(load_at_start)}
                )
        if baseline and family in _EXAMPLE_FAMILIES:
            load_at_start = os.getloadavg()[0]
            example = measure_example_connector(
                model_dir,
                storage_dir=scratch / f"example-{family}",
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
            )
            family_rows.append(
                _row(
                    family,
                    "ExampleConnector (vLLM)",
                    samples_s=example["samples_s"],
                    local_s=first_local,  # prefix caching off there: the file-store engine's local hits
                    ext_tokens=int(statistics.median(example["num_cached_tokens"]["external"])),
                    loaded_bytes=int(statistics.median(example["file_bytes"])),
                    loaded_keys=None,
                    memcpy_gbps=memcpy_gbps,
                )
                | {"local_hit_ms": None, "loadavg_1m": _load_change(load_at_start)}
            )
            details[f"{family}/ExampleConnector"] = example
        elif baseline:
            not_measured.append(
                f"{family}: no ExampleConnector baseline (it does not support the hybrid KV-cache manager)"
            )
        peer_row = next((row for row in family_rows if row["connector"] == PEER_CONNECTOR), None)
        peer_overhead = peer_row["overhead_ms"] if peer_row is not None else None
        if peer_row is not None and (peer_overhead is None or peer_overhead <= 0):
            # Noise larger than the hit: a ratio over it would mean nothing.
            not_measured.append(
                f"{family}: overhead_over_peer not computable: {PEER_CONNECTOR}'s overhead is "
                f"{format(peer_overhead, '.1f') if peer_overhead is not None else 'unknown'} ms "
                f"(external hit {peer_row['external_hit_ms']:.1f} ms, local hit {peer_row['local_hit_ms']:.1f} "
                f"ms, spread {peer_row['overhead_ms_spread']})"
            )
        for row in family_rows:
            if peer_overhead is not None and peer_overhead > 0:
                row["overhead_over_peer"] = _ratio(row["overhead_ms"], peer_overhead)
        rows.extend(family_rows)
    return rows, details, profiles, not_measured


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Bars of cold / local / external TTFT per (family, connector), log scale; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    labels = [f"{row['family']}\n{row['connector'].split(' ')[0]}" for row in rows]
    positions = list(range(len(rows)))
    figure, axes = plt.subplots(figsize=(max(6, len(rows) * 1.6), 4))
    for offset, key, label in (
        (-0.27, "cold_ms", "cold"),
        (0.0, "local_hit_ms", "local hit"),
        (0.27, "external_hit_ms", "external hit"),
    ):
        axes.bar([p + offset for p in positions], [row[key] or 0 for row in rows], width=0.27, label=label)
    axes.set_yscale("log")
    axes.set_xticks(positions, labels, fontsize=7)
    axes.set_ylabel(f"TTFT ms ({report['prompt_tokens']} tokens)")
    axes.legend()
    return save_figure(figure, path)
