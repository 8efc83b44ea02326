"""What the worker's pipelines share (:class:`WorkerContext`), and how ``register_kv_caches`` builds it.

``register_kv_caches`` learns, per group, each layer's per-block page (attention pages, raw Mamba state
pages, or a list of tensors per layer sharing one storage) and builds one
:class:`~hybridkv.connector.datapath.movers.BlockMover` per group. Host (CPU) caches are read and written in place;
CUDA caches get a :class:`~hybridkv.connector.datapath.staging.StagingContext` of :data:`STAGING_SLABS` pinned slabs
of about one PUT wave each (:func:`staging_for`). Host caches whose store may answer late move their bytes
through private buffers (:mod:`hybridkv.connector.worker.ownership`) from a
:class:`~hybridkv.connector.datapath.staging.HostBufferPool` of the same budget: :data:`STAGING_SLABS` PUT waves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import structlog
import torch
from hybridkv.connector.config import CUDA_COPY_DIRECTIONS, CUDA_COPY_PACKS, ConnectorConfig
from hybridkv.connector.datapath.movers import BlockMover, Fence, HostBufferPool, PinnedPool, StagingContext
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import BlockRef, LoadJob, LoadResult, SaveJob, SaveOutcome, SaveResult
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.vllm_geometry import ConnectorGeometry
from hybridkv.connector.worker.cpus import WorkerCpus
from hybridkv.connector.worker.layerwise import LayerTensors
from hybridkv.connector.worker.ownership import may_answer_late
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Store, Value

log = structlog.get_logger(__name__)

#: CUDA: pinned host slabs per worker (one save wave + one load batch in flight, one spare); host caches:
#: PUT waves of pooled private buffers (the same rule: a load round and a save wave are at most a wave each).
STAGING_SLABS = 3


@dataclass
class WorkerContext:
    """The store, counters, rank and KV block movers that the load and save pipelines share.

    Read per job, never cached by a pipeline: a harness that swaps the store or sets the ranks after
    ``register_kv_caches`` (``WorkerSide.store`` / ``tp_rank`` setters) changes the next job's.
    ``movers`` and ``staging`` are set once by ``register_kv_caches``, before any transfer.
    """

    cfg: ConnectorConfig
    #: layer names and group order only: keys come from the scheduler's KeyScheme in the metadata
    geo: ConnectorGeometry
    store: Store
    stats: StatsBox
    tp_rank: int = 0
    dcp_rank: int = 0
    #: store group id -> the group's block mover
    group_to_mover: dict[int, BlockMover] = field(default_factory=dict)
    #: CUDA caches (or a staging context given to ``register_kv_caches``): the staged path's slabs; else None
    staging: StagingContext | None = None
    #: where the pipelines' threads run (``worker_cpus``); the default leaves them where they start
    cpus: WorkerCpus = field(default_factory=lambda: WorkerCpus(None, "not resolved"))
    #: host path: the pre-faulted private buffers of store calls that may answer late (see ``private_buffers``)
    host_buffers: HostBufferPool = field(init=False)

    def __post_init__(self) -> None:
        self.host_buffers = HostBufferPool(STAGING_SLABS * self.cfg.put_wave_bytes)

    @property
    def is_staged(self) -> bool:
        return self.staging is not None

    def block_nbytes(self, group_index: int) -> int:
        """Bytes of one block of store group ``group_index`` (all its layers)."""
        return int(self.group_to_mover[group_index].block_nbytes)

    def fence(self) -> Fence:
        """CUDA: an event on the current (compute) stream; transfers queued after it wait for it."""
        return self.staging.fence() if self.staging is not None else None

    def keys(self, scheme: KeyScheme, refs: Sequence[BlockRef]) -> list[str]:
        """This rank's store key of each block."""
        return [scheme.key(ref.group_index, self.tp_rank, ref.block_hash) for ref in refs]

    def load_results(self, job: LoadJob, outcome: LoadOutcome) -> list[LoadResult]:
        return [LoadResult(ref.entry(self.tp_rank), outcome) for ref in job.blocks]

    def save_results(self, job: SaveJob, outcome: SaveOutcome) -> list[SaveResult]:
        return [SaveResult(ref.entry(self.tp_rank), outcome) for ref in job.blocks]

    def private_buffers(self, op: str) -> HostBufferPool | None:
        """Where a host-path ``op`` ("get" or "put") takes its batches' buffers: the pool when the store
        may answer late (it must never hold KV pages), None when it is handed the pages (and on CUDA,
        whose slabs are private already)."""
        if self.staging is None and may_answer_late(self.store, op):
            return self.host_buffers
        return None

    def batches(
        self, refs: Sequence[BlockRef], positions: Sequence[int], *, private: bool = False
    ) -> list[list[list[int]]]:
        """Rounds of per-group batches (positions into ``refs``) whose targets are held at once.

        Host caches: one round, one batch per group (no slabs, so no limit); with ``private`` (buffers
        from ``host_buffers``) a round ends at the block that reaches ``put_wave_bytes``, as a PUT wave
        does, so that a round's buffers fit the pool. CUDA: one batch per round, one group and at most one
        slab per batch.
        """
        by_group: dict[int, list[int]] = {}
        for i in positions:
            by_group.setdefault(refs[i].group_index, []).append(i)
        if self.staging is None and not private:
            return [list(by_group.values())]
        if self.staging is None:
            host_rounds: list[list[list[int]]] = []
            held: dict[int, list[int]] = {}
            nbytes = 0
            for group_index, idxs in by_group.items():
                for i in idxs:
                    held.setdefault(group_index, []).append(i)
                    nbytes += self.block_nbytes(group_index)
                    if nbytes >= self.cfg.put_wave_bytes:
                        host_rounds.append(list(held.values()))
                        held, nbytes = {}, 0
            if held:
                host_rounds.append(list(held.values()))
            return host_rounds
        rounds: list[list[list[int]]] = []
        for group_index, idxs in by_group.items():
            cap = self.group_to_mover[group_index].max_blocks
            rounds.extend([idxs[a : a + cap]] for a in range(0, len(idxs), cap))
        return rounds


def as_store_buffers(parts: list[list[np.ndarray]]) -> list[Value]:
    """Per-block numpy parts as store values. numpy arrays are buffers; its stubs declare the buffer
    protocol only for Python >= 3.12, hence the cast."""
    return cast("list[Value]", parts)


# ---------------------------------------------------------------------------------------- registration
def read_ranks(tp_size: int, dcp_size: int) -> tuple[int, int]:
    """This worker's (TP rank, DCP rank) from vLLM's parallel state, for a deployment of ``tp_size`` x
    ``dcp_size`` (from the vLLM config).

    No distributed environment at all (vLLM's world group not initialized): this process is not a worker
    of a distributed engine -- a single-process engine, a tool, or a test harness that sets the ranks
    itself -- so (0, 0). Every vLLM worker initializes the world group and the model-parallel groups before
    it registers its KV caches; once it has, a rank that cannot be read (an API that changed, a group that
    is missing, a group size that is not the configured one) raises RuntimeError naming what could not be
    read: a wrong rank would load and save other ranks' entries.
    """
    try:
        from vllm.distributed import parallel_state
    except ImportError as exc:
        raise RuntimeError(
            f"hybridkv: cannot import vllm.distributed.parallel_state to read the TP rank: {exc}"
        ) from exc
    if getattr(parallel_state, "_WORLD", None) is None:
        return 0, 0
    try:
        tp_group = parallel_state.get_tp_group()
        tp, tp_world = int(tp_group.rank_in_group), int(tp_group.world_size)
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: cannot read this worker's tensor-parallel rank from vLLM's parallel state "
            f"(vllm.distributed.parallel_state.get_tp_group().rank_in_group): {exc!r}"
        ) from exc
    if tp_world != tp_size:
        raise RuntimeError(
            f"hybridkv: vLLM's tensor-parallel group has {tp_world} ranks, the config says {tp_size}"
        )
    if dcp_size == 1:
        return tp, 0
    try:
        dcp = int(parallel_state.get_dcp_group().rank_in_group)
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: cannot read this worker's decode-context-parallel rank (dcp size {dcp_size}) from "
            f"vLLM's parallel state (vllm.distributed.parallel_state.get_dcp_group().rank_in_group): {exc!r}"
        ) from exc
    return tp, dcp


def kernel_directions(cuda_copy: str) -> frozenset[str]:
    """The directions ``cuda_copy`` routes straight through the copy kernel. Raises ValueError naming the key
    when ``kernel`` was asked for and Triton is missing."""
    directions = CUDA_COPY_DIRECTIONS[cuda_copy]
    if directions and not _copy_kernel_importable(cuda_copy):
        raise ValueError(
            f"kv_connector_extra_config['cuda_copy']: {cuda_copy!r} needs Triton, which cannot be imported; "
            "use 'dma' or 'auto'"
        )
    return directions


def packs_by_kernel(cuda_copy: str) -> bool:
    """Whether ``cuda_copy``'s DMA path packs its staging chunks with the copy kernel: not under ``dma``, nor
    when Triton is missing (``auto`` then packs by ``index_select``, and logs why)."""
    return CUDA_COPY_PACKS[cuda_copy] and _copy_kernel_importable(cuda_copy)


def _copy_kernel_importable(cuda_copy: str) -> bool:
    try:
        import hybridkv.connector.datapath.copy_kernels  # noqa: F401 -- Triton present?
    except ImportError as exc:
        log.warning(ConnectorLogEvent.COPY_KERNEL_UNAVAILABLE, cuda_copy=cuda_copy, error=str(exc))
        return False
    return True


def group_tensors(
    geo: ConnectorGeometry, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
) -> tuple[dict[int, list[list[torch.Tensor]]], torch.device]:
    """Per store group, each layer's tensors in the group's layer order (a list-of-tensors layer keeps its
    list), and the one device they all live on (CPU when there are none)."""
    group_to_layers: dict[int, list[list[torch.Tensor]]] = {}
    devices: set[torch.device] = set()
    for g in geo.groups:
        per_layer: list[list[torch.Tensor]] = []
        for name in g.layer_names:
            assert name in kv_caches, f"group {g.vllm_group_index}: layer {name!r} has no registered KV cache"
            t = kv_caches[name]
            tensors: list[torch.Tensor] = [t] if isinstance(t, torch.Tensor) else list(t)
            for x in tensors:
                assert x.device.type in ("cpu", "cuda"), (
                    f"layer {name!r}: HybridStoreConnector needs host or CUDA KV, got {x.device}"
                )
                devices.add(x.device)
            per_layer.append(tensors)
        group_to_layers[g.group_index] = per_layer
    assert len(devices) <= 1, f"KV caches on several devices: {sorted(map(str, devices))}"
    return group_to_layers, next(iter(devices)) if devices else torch.device("cpu")


def staging_for(
    device: torch.device, group_to_layers: dict[int, list[list[torch.Tensor]]], cfg: ConnectorConfig
) -> StagingContext:
    """The staging context of CUDA caches: :data:`STAGING_SLABS` pinned slabs, each one PUT wave (a wave
    ends at the first block that reaches ``put_wave_bytes``), with one slab pinned already."""
    block_max = max(
        sum(int(x[0].numel()) * x.element_size() for layer in layers for x in layer)
        for layers in group_to_layers.values()
    )
    num_tensors = max(sum(len(layer) for layer in layers) for layers in group_to_layers.values())
    slab = cfg.put_wave_bytes + block_max + 256 * num_tensors
    staging = StagingContext(
        device,
        PinnedPool(slab, STAGING_SLABS * slab, pin=True),
        kernel_directions=kernel_directions(cfg.cuda_copy),
        pack_by_kernel=packs_by_kernel(cfg.cuda_copy),
    )
    # Pin one slab now: page-locking it took ~0.1 s (128 MiB, H200 host), which the first transfer would
    # otherwise wait for -- on a load, the first hit.
    pinned_slab = staging.pool.acquire()
    assert pinned_slab is not None, "a fresh staging pool has a slab to give"
    staging.pool.release(pinned_slab)
    return staging


def layer_tensors(
    geo: ConnectorGeometry, group_to_layers: dict[int, list[list[torch.Tensor]]]
) -> dict[int, list[LayerTensors]]:
    """Per store group, its layers by name with the indices of their tensors in the group's mover."""
    group_to_layer_tensors: dict[int, list[LayerTensors]] = {}
    for g in geo.groups:
        first = 0
        group_to_layer_tensors[g.group_index] = []
        for name, tensors in zip(g.layer_names, group_to_layers[g.group_index], strict=True):
            group_to_layer_tensors[g.group_index].append(
                LayerTensors(name, tuple(range(first, first + len(tensors))))
            )
            first += len(tensors)
    return group_to_layer_tensors
