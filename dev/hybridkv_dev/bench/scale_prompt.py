"""How the external hit's load grows with the prompt (``hybridkv bench scale --axis prompt-length``).

Measured at the worker level, not through a vLLM engine: a real engine's prefill of 64K tokens on 2 CPU
cores takes minutes per round (and the hit rounds need that prefill first), so the axis drives the
connector's worker half (``WorkerSide``, the object vLLM's worker-role calls reach) over real vLLM config
objects and host KV tensors of ``hybridkv bench ttft``'s default geometry: the tiny llama at ``size=bench``
(8 layers, 4 KV heads x 128, bfloat16: 16 KiB of KV per token, blocks of 16 tokens, vLLM's CPU layout
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` per layer), on a ``file://`` store under
``/dev/shm`` (the ttft bench's default place) with the default checksum.

For each prompt of N tokens (``sizes``), its N/16 blocks are saved once through the worker's own save path
(untimed: ``enqueue_saves`` + ``flush``), under block hashes of that size's own. Repeats interleave the
sizes; each repeat of a size times:

- ``load``: one load job of the whole hit (``start_load`` of a ``LoadJob`` of the N/16 blocks into their KV
  pages, then ``transfer_results`` until it finished): ``load_job_ms`` is the worker's own
  ``load_job_seconds`` (the load thread's wall time of the job: the same figure ``hybridkv bench ttft``
  reports as its load job), ``load_wall_ms`` from ``start_load`` until the result was seen,
- ``memcpy``: one ``np.copyto`` of the same number of bytes between two pre-touched buffers, right after,
  in the same process (the copy floor).

Each repeat also splits its load job (``<phase>_ms``): the worker's ``LoadProbe`` (building the
destinations, the store's ``get_into``, committing) and the file store's ``ReadProbe`` (open, ``readv``,
verify, close, summed over the store's reader threads), the probes ``hybridkv bench ttft`` hangs in too.

After the repeats (untimed), the smallest hit's pages are zeroed and loaded again: ``pages_intact`` says
they then hold the bytes saved from them.

Not measured here: the scheduler half's lookup and the engine steps around the load (the hit's overhead
above a local hit needs the engine: ``hybridkv bench ttft --prompt-tokens``). The report holds the medians
over repeats with their spread (min..max), per-token costs, the ratio load / memcpy, the load average
before and after, and the target: the load's per-token cost at the largest prompt within 1.5x of the
smallest's.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hybridkv.bench.report import pyplot_or_none, save_figure
from hybridkv.bench.store import bench_scratch_dir

from hybridkv_dev.bench.scale import add_medians, growth_targets, medians_and_spreads

__all__ = [
    "AXIS",
    "BLOCK_TOKENS",
    "DEFAULT_SIZES",
    "TABLE_COLUMNS",
    "format_prompt_table",
    "plot_prompt_report",
    "run_prompt_length_axis",
]

AXIS = "prompt-length"
DEFAULT_SIZES = (1024, 4096, 16384, 65536)
#: vLLM's block size in ``hybridkv bench ttft``'s engines (one store entry per block).
BLOCK_TOKENS = 16
#: ``hybridkv bench ttft``'s default model: family, tiny-model size, dtype.
FAMILY, MODEL_SIZE, DTYPE = "llama", "bench", "bfloat16"
_LOAD_WAIT_S = 120.0

TABLE_COLUMNS = [
    "tokens",
    "repeats",
    "blocks",
    "loaded_mib",
    "load_job_ms",
    "load_wall_ms",
    "memcpy_ms",
    "load_over_memcpy",
    "load_us_per_token",
    "memcpy_us_per_token",
    "load_gbps",
    "memcpy_gbps",
]

_TIMED = ("load_job_ms", "load_wall_ms", "memcpy_ms", "load_over_memcpy", "load_us_per_token")
#: The load job's phases reported per repeat (``<name>_ms``): the worker's ``LoadProbe`` (targets, the
#: store's get_into, commit) and the file store's ``ReadProbe`` (summed over its reader threads).
_PHASES = ("targets", "store", "commit", "file_open", "file_read", "file_verify", "file_close")

_GROWTH_TARGETS = (
    ("load job us/token growth", "load_us_per_token"),
    ("load / memcpy growth", "load_over_memcpy"),
)


def _geometry() -> dict[str, int]:
    """The ttft bench's default model's KV geometry (every layer full attention)."""
    from hybridkv.demo.tiny_models import tiny_config_kwargs

    _, kw = tiny_config_kwargs(FAMILY, size=MODEL_SIZE)
    head_dim = int(kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"])
    num_layers = int(kw["num_hidden_layers"])
    num_kv_heads = int(kw["num_key_value_heads"])
    itemsize = 2  # bfloat16
    page_bytes = 2 * BLOCK_TOKENS * num_kv_heads * head_dim * itemsize
    return {
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_tokens": BLOCK_TOKENS,
        "page_bytes": page_bytes,
        "bytes_per_token": num_layers * page_bytes // BLOCK_TOKENS,
    }


def _layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def _kv_cache_config(geometry: dict[str, int], num_blocks: int) -> Any:
    """One full-attention group over every layer, one tensor per layer (layer-outermost)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS,
        num_kv_heads=geometry["num_kv_heads"],
        head_size=geometry["head_dim"],
        dtype=torch.bfloat16,
    )
    names = [_layer_name(layer) for layer in range(geometry["num_layers"])]
    page = geometry["page_bytes"]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * page, layers=[name], layer_stride=0, block_stride=page)
            for name in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def _block_refs(tokens: int) -> tuple[Any, ...]:
    """The hit's blocks: block i at KV page i, keyed by a hash of this prompt length's own."""
    from hybridkv.connector.metadata import BlockRef

    return tuple(
        BlockRef(
            group_index=0,
            vllm_group_index=0,
            index=i,
            block_id=i,
            block_hash=hashlib.sha256(f"prompt-{tokens}-block-{i}".encode()).digest(),
            key_boundary=(i + 1) * BLOCK_TOKENS,
        )
        for i in range(tokens // BLOCK_TOKENS)
    )


def _wait_load(worker: Any, req_id: str) -> bool:
    """Poll ``transfer_results`` until ``req_id`` finished; whether it loaded without a failure."""
    deadline = time.monotonic() + _LOAD_WAIT_S
    while time.monotonic() < deadline:
        done, failed = worker.transfer_results()
        if req_id in done:
            return req_id not in failed
    raise RuntimeError(f"load of {req_id} did not finish within {_LOAD_WAIT_S} s")


@dataclass
class _Rig:
    """The worker half over host KV pages, its key scheme and its KV tensors (by layer name)."""

    worker: Any
    scheme: Any
    caches: dict[str, Any]
    #: where the load jobs spend their time: the worker's phases and the file store's read phases
    load_probe: Any
    read_probe: Any

    def phases(self) -> dict[str, float]:
        """The probes' sums so far (seconds; ``file_*``: summed over reader threads)."""
        out = {name: float(value) for name, value in self.load_probe.totals().items()}
        return out | {f"file_{name}": float(value) for name, value in self.read_probe.totals().items()}

    def load(self, req_id: str, tokens: int, refs: tuple[Any, ...]) -> bool:
        """One load job of ``refs`` (a hit of ``tokens`` tokens) into their pages; whether it loaded."""
        from hybridkv.connector.metadata import HybridStoreMetadata, LoadJob

        self.worker.start_load(HybridStoreMetadata(scheme=self.scheme, loads=[LoadJob(req_id, tokens, refs)]))
        return _wait_load(self.worker, req_id)


def _open_rig(url: str, geometry: dict[str, int], num_blocks: int, models_dir: Path | None) -> _Rig:
    """A ``WorkerSide`` on ``url`` over real vLLM config objects of the ttft bench's model, with
    ``num_blocks`` random KV pages per layer registered."""
    import torch
    from hybridkv.connector.config import ConnectorConfig
    from hybridkv.connector.vllm_geometry import resolve_geometry
    from hybridkv.connector.worker.load_probe import LoadProbe
    from hybridkv.connector.worker.side import WorkerSide
    from hybridkv.demo import vllm_harness
    from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
    from hybridkv.store.base import find_layer
    from hybridkv.store.file import FileBackend
    from hybridkv.store.file.probe import ReadProbe

    model_dir = build_tiny_model(FAMILY, models_dir or DEFAULT_MODELS_DIR, size=MODEL_SIZE)
    vllm_config = vllm_harness.connector_vllm_config(
        model_dir, {"store": url}, block_size=BLOCK_TOKENS, num_blocks=num_blocks
    )
    kv_cache_config = _kv_cache_config(geometry, num_blocks)
    vllm_harness.resolve_cache_block_sizes(kv_cache_config, vllm_config)
    scheme = resolve_geometry(vllm_config, kv_cache_config, "scale", check_vllm_sizes=True).scheme
    config = ConnectorConfig.from_extra_config({"store": url}, model="m")
    worker = WorkerSide(vllm_config, kv_cache_config, config)
    generator = torch.Generator().manual_seed(0)
    shape = (num_blocks, geometry["num_kv_heads"], BLOCK_TOKENS, 2 * geometry["head_dim"])
    caches = {
        _layer_name(layer): torch.randn(*shape, generator=generator).to(torch.bfloat16)
        for layer in range(geometry["num_layers"])
    }
    try:
        worker.register_kv_caches(caches)
        load_probe, read_probe = LoadProbe(), ReadProbe()
        worker.install_load_probe(load_probe)
        backend = find_layer(worker.store, FileBackend)
        assert backend is not None, f"{url} has no file backend"
        backend.install_read_probe(read_probe)
    except BaseException:
        worker.shutdown()
        raise
    return _Rig(worker, scheme, caches, load_probe, read_probe)


def _save(rig: _Rig, refs_by_size: dict[int, tuple[Any, ...]], progress: Callable[[str], None]) -> None:
    """Every prompt's blocks through the worker's own save path (untimed)."""
    from hybridkv.connector.metadata import HybridStoreMetadata, SaveJob

    for job_id, (tokens, refs) in enumerate(refs_by_size.items()):
        save = SaveJob(job_id, f"save-{tokens}", refs)
        rig.worker.enqueue_saves(HybridStoreMetadata(scheme=rig.scheme, saves=[save]))
        assert rig.worker.flush(timeout=_LOAD_WAIT_S), f"saving the {tokens}-token prompt did not finish"
        progress(f"saved {tokens} tokens ({len(refs)} blocks)")


def _measure(
    rig: _Rig, req_id: str, tokens: int, refs: tuple[Any, ...], num_bytes: int, floor: tuple[Any, Any]
) -> dict[str, float]:
    """One repeat of one prompt length: its load job, then one memcpy of its bytes."""
    totals = rig.worker.stats.totals
    job_before = float(totals.get("load_job_seconds", 0.0))
    bytes_before = float(totals.get("load_bytes", 0.0))
    phases_before = rig.phases()
    start = time.perf_counter()
    ok = rig.load(req_id, tokens, refs)
    wall_s = time.perf_counter() - start
    job_s = float(totals.get("load_job_seconds", 0.0)) - job_before
    phases = {name: value - phases_before[name] for name, value in rig.phases().items()}
    source, destination = floor
    start = time.perf_counter()
    np.copyto(destination[:num_bytes], source[:num_bytes])
    memcpy_s = time.perf_counter() - start
    return {
        "ok": float(ok),
        "loaded_bytes": float(totals.get("load_bytes", 0.0)) - bytes_before,
        "load_job_ms": job_s * 1e3,
        "load_wall_ms": wall_s * 1e3,
        "memcpy_ms": memcpy_s * 1e3,
        "load_over_memcpy": job_s / memcpy_s,
        "load_us_per_token": job_s * 1e6 / tokens,
        **{f"{name}_ms": phases[f"{name}_s"] * 1e3 for name in _PHASES},
    }


def _pages_intact(rig: _Rig, tokens: int, refs: tuple[Any, ...]) -> bool:
    """Untimed: the hit's pages zeroed, then loaded again, hold what was saved from them."""
    import torch

    pages = tokens // BLOCK_TOKENS
    saved = {name: cache[:pages].clone() for name, cache in rig.caches.items()}
    for cache in rig.caches.values():
        cache[:pages].zero_()
    loaded = rig.load("verify", tokens, refs)
    return loaded and all(torch.equal(rig.caches[name][:pages], want) for name, want in saved.items())


def run_prompt_length_axis(
    scratch_parent: str | None,
    sizes: Sequence[int],
    *,
    repeats: int,
    models_dir: Path | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """The ``prompt-length`` axis (see the module docstring); returns the report. Its store lives in a new
    folder under ``scratch_parent`` (default: ``/dev/shm`` when present), removed at the end. ``sizes``:
    prompt tokens, each a multiple of ``BLOCK_TOKENS``."""
    sizes = sorted(set(sizes))
    assert sizes and all(size > 0 and size % BLOCK_TOKENS == 0 for size in sizes), (
        f"sizes must be positive multiples of {BLOCK_TOKENS} tokens, got {sizes}"
    )
    assert repeats >= 1, f"repeats must be >= 1, got {repeats}"
    geometry = _geometry()
    bytes_per_token = geometry["bytes_per_token"]
    # Room for every prompt's frames twice over: the store never evicts during the axis.
    capacity = 2 * sum(sizes) * bytes_per_token + (64 << 20)
    with bench_scratch_dir(scratch_parent) as scratch:
        url = f"file://{scratch}/store?capacity={capacity}"
        return _run(url, sizes, geometry, repeats=repeats, models_dir=models_dir, progress=progress)


def _run(
    url: str,
    sizes: list[int],
    geometry: dict[str, int],
    *,
    repeats: int,
    models_dir: Path | None,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    bytes_per_token = geometry["bytes_per_token"]
    rig = _open_rig(url, geometry, sizes[-1] // BLOCK_TOKENS, models_dir)
    load_before = os.getloadavg()
    try:
        refs_by_size = {tokens: _block_refs(tokens) for tokens in sizes}
        _save(rig, refs_by_size, progress)
        saved_bytes = float(rig.worker.stats.totals.get("save_bytes", 0.0))
        # The copy floor's buffers, touched once: a fresh page's fault is no part of a copy.
        largest_bytes = sizes[-1] * bytes_per_token
        floor = (np.ones(largest_bytes, dtype=np.uint8), np.zeros(largest_bytes, dtype=np.uint8))
        samples: dict[int, list[dict[str, float]]] = {tokens: [] for tokens in sizes}
        for repeat in range(repeats):
            for tokens, refs in refs_by_size.items():
                sample = _measure(
                    rig, f"hit-{tokens}-{repeat}", tokens, refs, tokens * bytes_per_token, floor
                )
                samples[tokens].append(sample)
            progress(f"repeat {repeat + 1}/{repeats} done")
        intact = _pages_intact(rig, sizes[0], refs_by_size[sizes[0]])
    finally:
        rig.worker.shutdown()
    load_after = os.getloadavg()
    rows = [_row(tokens, samples[tokens], geometry) for tokens in sizes]
    return {
        "bench": "scale",
        "axis": AXIS,
        "store": "file",
        "level": "worker: WorkerSide.start_load of one LoadJob into host KV pages (no engine)",
        "model": {"family": FAMILY, "size": MODEL_SIZE, "dtype": DTYPE, **geometry},
        "repeats": repeats,
        "saved_bytes": saved_bytes,
        "pages_intact": intact,
        "cpu_count": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "rows": rows,
        "targets": _targets(rows),
    }


def _row(tokens: int, samples: list[dict[str, float]], geometry: dict[str, int]) -> dict[str, Any]:
    num_bytes = tokens * geometry["bytes_per_token"]
    row: dict[str, Any] = {
        "tokens": tokens,
        "repeats": len(samples),
        "blocks": tokens // BLOCK_TOKENS,
        "hit_bytes": num_bytes,
        "loaded_mib": num_bytes / (1 << 20),
        "loads_ok": int(sum(sample["ok"] for sample in samples)),
        "loaded_bytes_min": int(min(sample["loaded_bytes"] for sample in samples)),
    }
    add_medians(row, samples, _TIMED)
    for name in _PHASES:
        row[f"{name}_ms"] = statistics.median(sample[f"{name}_ms"] for sample in samples)
    row["memcpy_us_per_token"] = row["memcpy_ms"] * 1e3 / tokens
    row["load_gbps"] = num_bytes / (row["load_job_ms"] / 1e3) / 1e9
    row["memcpy_gbps"] = num_bytes / (row["memcpy_ms"] / 1e3) / 1e9
    row["samples"] = samples
    return row


def _targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Growth targets between the smallest and the largest prompt (none with a single size)."""
    return growth_targets(rows, _GROWTH_TARGETS)


def format_prompt_table(report: dict[str, Any]) -> str:
    """The medians per prompt length, then each timed metric's spread over repeats."""
    from hybridkv.tables import format_table

    rows = report["rows"]
    phases = [f"{name}_ms" for name in _PHASES]
    return (
        "medians over repeats:\n"
        + medians_and_spreads(rows, TABLE_COLUMNS, "tokens", _TIMED)
        + "\nthe load job's phases, medians (ms; file_*: summed over the store's reader threads):\n"
        + format_table(rows, ["tokens", "load_job_ms", *phases])
    )


def plot_prompt_report(report: dict[str, Any], path: Path) -> Path | None:
    """Load and memcpy per token, and their ratio, against the prompt length (log x); ``None`` without
    matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(9, 4))
    tokens = [row["tokens"] for row in report["rows"]]
    for column in ("load_us_per_token", "memcpy_us_per_token"):
        axes[0].plot(tokens, [row[column] for row in report["rows"]], marker="o", label=column)
    axes[0].legend()
    axes[1].plot(tokens, [row["load_over_memcpy"] for row in report["rows"]], marker="o")
    axes[1].set_title("load / memcpy")
    for axis in axes:
        axis.set_xscale("log")
        axis.set_xlabel("prompt tokens")
        axis.set_ylim(bottom=0)
    return save_figure(figure, path)
