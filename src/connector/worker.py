"""The worker half of ``HybridStoreConnector``: block bytes in and out of the store, off the forward path.

Contracts:

- ``register_kv_caches`` learns, per group, each layer's per-block page (attention pages, raw Mamba state
  pages, or a list of tensors per layer sharing one storage). A group block's value is the concatenation of
  that block's bytes across the group's layers, in the group's layer order; the per-layer slices are passed
  to the store as parts (zero copies for contiguous pages, one staging copy otherwise).
- Loads run on a thread. Every load job this rank receives is reported in ``finished_recving`` once done;
  a job with any non-OK block is also in ``failed_recving`` (request-level, safe for hybrid models).
  ``get_block_ids_with_load_errors`` is always empty.
- Saves are enqueued in ``wait_for_save`` (on CPU the forward already finished, so the bytes are final; the
  scheduler pins the source blocks until every rank reports the job). They go out in PUT waves of at most
  ``put_wave_bytes``; at most ``_MAX_WAVES_IN_FLIGHT`` waves' bytes are queued per rank, beyond that a job is
  dropped and counted (a slow or full store never stalls the engine). ``NO_SPACE`` drops the wave.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.geometry import ConnectorGeometry, resolve_geometry
from hybridkv.connector.metadata import (
    BlockRef,
    HybridStoreMetadata,
    HybridStoreWorkerMetadata,
    LoadJob,
    SaveJob,
)
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.stores import open_connector_store
from hybridkv.lifecycle.geometry import KeyScheme

log = structlog.get_logger(__name__)

_MAX_WAVES_IN_FLIGHT = 4


def _block_views(t: torch.Tensor, block_id: int) -> tuple[np.ndarray, bool]:
    """The bytes of one block of a per-layer cache tensor, as a uint8 numpy view (and whether it is one)."""
    page = t[block_id]
    if page.is_contiguous():
        return page.reshape(-1).view(torch.uint8).numpy(), True
    return page.contiguous().reshape(-1).view(torch.uint8).numpy(), False


def _ranks() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_dcp_group, get_tensor_model_parallel_rank

    tp = int(get_tensor_model_parallel_rank())
    try:
        dcp = int(get_dcp_group().rank_in_group)
    except Exception:  # noqa: BLE001 -- DCP group not initialized: no DCP
        dcp = 0
    return tp, dcp


class WorkerSide:
    """Worker-role state. One per worker process (TP rank)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        # Layer names and group order only: keys come from the scheduler's KeyScheme in the metadata.
        self.geo: ConnectorGeometry = resolve_geometry(
            vllm_config, kv_cache_config, cfg.namespace, check_vllm_sizes=False
        )
        self.store = open_connector_store(cfg)
        self.stats = StatsBox()
        self.tp_rank, self.dcp_rank = 0, 0
        self._layers: dict[int, list[list[torch.Tensor]]] = {}  # sgid -> per layer -> tensors
        self._lock = threading.Lock()
        self._loads_done: dict[str, bool] = {}
        self._load_results: dict[str, list[tuple[int, int, int, int, str]]] = {}
        self._pending_load_results: dict[str, list[tuple[int, int, int, int, str]]] = {}
        self._save_results: dict[int, list[tuple[int, int, int, int, str]]] = {}
        self._saves_done: list[int] = []
        self._inflight_bytes = 0
        self._load_q: queue.Queue[tuple[KeyScheme, LoadJob] | None] = queue.Queue()
        # Items: (scheme, job, bytes) to write, a threading.Event to set once everything before it is
        # written (flush), or None to stop.
        self._save_q: queue.Queue[tuple[KeyScheme, SaveJob, int] | threading.Event | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._load_loop, name="hybridkv-load", daemon=True),
            threading.Thread(target=self._save_loop, name="hybridkv-save", daemon=True),
        ]
        for th in self._threads:
            th.start()

    # ------------------------------------------------------------------ layout
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
        try:
            self.tp_rank, self.dcp_rank = _ranks()
        except Exception:  # noqa: BLE001 -- parallel state not initialized (unit tests): rank 0
            self.tp_rank, self.dcp_rank = 0, 0
        dcp = self.geo.geometry.topology.dcp_size
        assert self.tp_rank % dcp == self.dcp_rank, (
            f"dcp rank {self.dcp_rank} != tp rank {self.tp_rank} % dcp {dcp}"
        )
        for g in self.geo.groups:
            per_layer: list[list[torch.Tensor]] = []
            for name in g.layer_names:
                assert name in kv_caches, f"group {g.gid}: layer {name!r} has no registered KV cache"
                t = kv_caches[name]
                tensors: list[torch.Tensor] = list(t) if isinstance(t, (list, tuple)) else [t]  # type: ignore[list-item]
                for x in tensors:
                    assert x.device.type == "cpu", (
                        f"layer {name!r}: HybridStoreConnector needs host KV, got {x.device}"
                    )
                per_layer.append(tensors)
            self._layers[g.sgid] = per_layer
        log.info(
            "hybridkv worker geometry",
            tp_rank=self.tp_rank,
            dcp_rank=self.dcp_rank,
            store=self.store.url,
            block_bytes={g.sgid: self.block_nbytes(g.sgid) for g in self.geo.groups},
            **self.geo.describe(),
        )

    def block_nbytes(self, sgid: int) -> int:
        return sum(t[0].numel() * t.element_size() for layer in self._layers[sgid] for t in layer)

    def _parts(self, ref: BlockRef) -> tuple[list[np.ndarray], list[tuple[torch.Tensor, np.ndarray]]]:
        """Per-layer byte views of one block; non-contiguous pages come with (tensor page, staging) pairs."""
        parts: list[np.ndarray] = []
        staged: list[tuple[torch.Tensor, np.ndarray]] = []
        for layer in self._layers[ref.sgid]:
            for t in layer:
                view, direct = _block_views(t, ref.block_id)
                parts.append(view)
                if not direct:
                    staged.append((t[ref.block_id], view))
        return parts, staged

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: HybridStoreMetadata) -> None:
        for job in meta.loads:
            self._load_q.put((meta.scheme, job))

    def _load_loop(self) -> None:
        while (item := self._load_q.get()) is not None:
            scheme, job = item
            results: list[tuple[int, int, int, int, str]] = []
            ok = True
            try:
                keys = [scheme.key(ref.sgid, self.tp_rank, ref.block_hash) for ref in job.blocks]
                dests = []
                staged_all = []
                for ref in job.blocks:
                    parts, staged = self._parts(ref)
                    dests.append(parts)
                    staged_all.append(staged)
                statuses = self.store.get_into(keys, dests) if keys else []
                nbytes = 0
                for ref, st, staged, parts in zip(job.blocks, statuses, staged_all, dests, strict=True):
                    if st.is_ok:
                        for page, view in staged:
                            page.copy_(torch.from_numpy(view).view(page.dtype).view(page.shape))
                        nbytes += sum(p.nbytes for p in parts)
                    else:
                        ok = False
                        self.stats.add("load_failed_keys")
                    results.append((self.tp_rank, ref.sgid, ref.index, ref.key_boundary, st.value))
                self.stats.add("load_keys", len(keys))
                self.stats.add("load_bytes", nbytes)
            except Exception as exc:  # noqa: BLE001 -- a store bug must not kill the engine: the request recomputes
                log.warning("hybridkv load raised", request_id=job.req_id, error=repr(exc))
                ok = False
                results = [
                    (self.tp_rank, ref.sgid, ref.index, ref.key_boundary, "transfer_failed")
                    for ref in job.blocks
                ]
            with self._lock:
                self._loads_done[job.req_id] = ok
                self._pending_load_results[job.req_id] = results

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; failed is a subset of finished."""
        with self._lock:
            done, self._loads_done = self._loads_done, {}
            for rid, res in self._pending_load_results.items():
                self._load_results.setdefault(rid, []).extend(res)
            self._pending_load_results = {}
        return set(done), {rid for rid, ok in done.items() if not ok}

    # ------------------------------------------------------------------ saves
    def enqueue_saves(self, meta: HybridStoreMetadata) -> None:
        budget = self.cfg.put_wave_bytes * _MAX_WAVES_IN_FLIGHT
        for job in meta.saves:
            nbytes = sum(self.block_nbytes(ref.sgid) for ref in job.blocks)
            with self._lock:
                admit = self._inflight_bytes == 0 or self._inflight_bytes + nbytes <= budget
                if admit:
                    self._inflight_bytes += nbytes
            if admit:
                self._save_q.put((meta.scheme, job, nbytes))
            else:
                self.stats.add("put_wave_drops")
                self._finish_save(
                    job,
                    [(self.tp_rank, ref.sgid, ref.index, ref.key_boundary, "dropped") for ref in job.blocks],
                )

    def _finish_save(self, job: SaveJob, results: list[tuple[int, int, int, int, str]]) -> None:
        with self._lock:
            self._save_results.setdefault(job.job_id, []).extend(results)
            self._saves_done.append(job.job_id)

    def _save_loop(self) -> None:
        while (item := self._save_q.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            scheme, job, nbytes = item
            try:
                results = self._put_job(scheme, job)
            except Exception as exc:  # noqa: BLE001 -- a store failure must never reach the engine
                log.warning("hybridkv save raised", request_id=job.req_id, error=repr(exc))
                results = [
                    (self.tp_rank, ref.sgid, ref.index, ref.key_boundary, "transfer_failed")
                    for ref in job.blocks
                ]
            with self._lock:
                self._inflight_bytes -= nbytes
            self._finish_save(job, results)

    def _put_job(self, scheme: KeyScheme, job: SaveJob) -> list[tuple[int, int, int, int, str]]:
        keys = [scheme.key(ref.sgid, self.tp_rank, ref.block_hash) for ref in job.blocks]
        status: dict[int, str] = {}
        # Insert-if-absent makes duplicates harmless; asking first saves reading and sending the bytes.
        for i, st in enumerate(self.store.exists(keys)):
            if st.is_ok:
                status[i] = "ok"
                self.stats.add("save_skipped_keys")
        todo = [i for i in range(len(keys)) if i not in status]
        wave: list[int] = []
        wave_bytes = 0
        for pos, i in enumerate(todo):
            wave.append(i)
            wave_bytes += self.block_nbytes(job.blocks[i].sgid)
            if wave_bytes >= self.cfg.put_wave_bytes or pos == len(todo) - 1:
                self._put_wave(job, keys, wave, status)
                wave, wave_bytes = [], 0
        return [
            (self.tp_rank, ref.sgid, ref.index, ref.key_boundary, status.get(i, "dropped"))
            for i, ref in enumerate(job.blocks)
        ]

    def _put_wave(self, job: SaveJob, keys: list[str], wave: list[int], status: dict[int, str]) -> None:
        values = [self._parts(job.blocks[i])[0] for i in wave]
        statuses = self.store.put([keys[i] for i in wave], values)
        self.stats.add("save_calls")
        if any(st.value == "no_space" for st in statuses):
            self.stats.add("put_wave_drops")
        for i, vals, st in zip(wave, values, statuses, strict=True):
            status[i] = "ok" if st.is_ok else st.value
            if st.is_ok:
                self.stats.add("save_keys")
                self.stats.add("save_bytes", sum(v.nbytes for v in vals))
            else:
                self.stats.add("save_failed_keys")

    def worker_meta(self) -> HybridStoreWorkerMetadata | None:
        with self._lock:
            wm = HybridStoreWorkerMetadata(
                loads=self._load_results,
                saves=self._save_results,
                saves_done={j: [self.tp_rank] for j in self._saves_done},
            )
            self._load_results, self._save_results, self._saves_done = {}, {}, []
        return None if wm.is_empty() else wm

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every save queued so far is written (shutdown; tests). False on timeout."""
        marker = threading.Event()
        self._save_q.put(marker)
        return marker.wait(timeout)

    def shutdown(self) -> None:
        self.flush()
        self._load_q.put(None)
        self._save_q.put(None)
        for th in self._threads:
            th.join(timeout=10)
        self.store.close()
