"""Messages between the connector's halves.

- :class:`HybridStoreMetadata` (scheduler -> every worker, one per step): load jobs and save jobs, plus the
  scheduler's ``KeyScheme``; each worker derives its own keys (``scheme.key(group, tp_rank, hash)``), so one
  message serves all ranks and every rank names entries exactly as the scheduler looked them up.
- :class:`HybridStoreWorkerMetadata` (worker -> scheduler, one per step, ``aggregate()`` merges ranks):
  per-(rank, group, block) load results and per-(rank, entry) save results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.lifecycle.keys import KeyScheme
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockRef:
    """One group block: which group, where in the block table, which physical block, which key."""

    sgid: int
    gid: int
    index: int  # block-table position (tokens [index*span, (index+1)*span)); Mamba: cdiv(boundary, span) - 1
    block_id: int
    block_hash: bytes  # the hash that keys the entry (at ``key_boundary``)
    key_boundary: int


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    boundary: int
    blocks: tuple[BlockRef, ...]


@dataclass(frozen=True)
class SaveJob:
    job_id: int
    req_id: str
    blocks: tuple[BlockRef, ...]


@dataclass
class HybridStoreMetadata(KVConnectorMetadata):
    scheme: KeyScheme
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


#: (tp_rank, sgid, block index, key boundary, status value) -- the lifecycle's ``EntryId`` plus a status
LoadResult = tuple[int, int, int, int, str]
SaveResult = tuple[int, int, int, int, str]


@dataclass
class HybridStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Results since the previous step, keyed by request (loads) and job (saves), lists over ranks."""

    loads: dict[str, list[LoadResult]] = field(default_factory=dict)
    saves: dict[int, list[SaveResult]] = field(default_factory=dict)
    #: job id -> ranks that finished it (a rank that dropped or failed a job still finishes it)
    saves_done: dict[int, list[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> HybridStoreWorkerMetadata:
        assert isinstance(other, HybridStoreWorkerMetadata), f"cannot merge {type(other).__name__}"
        out = HybridStoreWorkerMetadata(
            loads={k: list(v) for k, v in self.loads.items()},
            saves={k: list(v) for k, v in self.saves.items()},
            saves_done={k: list(v) for k, v in self.saves_done.items()},
        )
        for k, v in other.loads.items():
            out.loads.setdefault(k, []).extend(v)
        for j, v in other.saves.items():
            out.saves.setdefault(j, []).extend(v)
        for j, ranks in other.saves_done.items():
            out.saves_done.setdefault(j, []).extend(ranks)
        return out

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.saves_done)
