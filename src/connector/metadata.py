"""Messages between the connector's halves.

- :class:`HybridStoreMetadata` (scheduler -> every worker, one per step): load jobs and save jobs, plus the
  scheduler's ``KeyScheme``; each worker derives its own keys (``scheme.key(group, tp_rank, hash)``), so one
  message serves all ranks and every rank names entries exactly as the scheduler looked them up.
- :class:`HybridStoreWorkerMetadata` (worker -> scheduler, one per step, ``aggregate()`` merges ranks):
  typed per-entry results -- :class:`LoadResult` (the lifecycle's ``EntryId`` and ``LoadOutcome``) and
  :class:`SaveResult` (``EntryId`` and :class:`SaveOutcome`) -- and the ranks that finished each save job.

Everything here crosses process boundaries inside vLLM's ``ModelRunnerOutput`` (pickled by the
multiprocess executor's message queue), so results are small named tuples of ints and enum members.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload

from hybridkv.connector.outcomes import SaveOutcome
from hybridkv.lifecycle.keys import EntryId, KeyScheme, PlannedBlock
from hybridkv.lifecycle.load import LoadOutcome
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

__all__ = [
    "BlockRef",
    "HybridStoreMetadata",
    "HybridStoreWorkerMetadata",
    "LoadJob",
    "LoadResult",
    "PlannedRefs",
    "SaveJob",
    "SaveOutcome",  # the type of SaveResult.outcome (its one holder: hybridkv.connector.outcomes)
    "SaveResult",
]


@dataclass(frozen=True)
class BlockRef:
    """One group block: which group, where in the block table, which physical block, which key."""

    group_index: int
    vllm_group_index: int
    index: int  # block-table position (tokens [index*span, (index+1)*span)); Mamba: cdiv(boundary, span) - 1
    block_id: int
    block_hash: bytes  # the hash that keys the entry (at ``key_boundary``)
    key_boundary: int

    def entry(self, tp_rank: int) -> EntryId:
        """This block's stored entry on ``tp_rank``."""
        return EntryId(tp_rank, self.group_index, self.index, self.key_boundary)


class PlannedRefs(Sequence[BlockRef]):
    """A job's blocks, kept as the plan's blocks plus the physical block id of each, and expanded into
    :class:`BlockRef` objects on first use.

    The scheduler's step only looks the block ids up (one slice lookup per group); the objects a 128K-token
    hit needs (thousands) are built where they are used: in each worker process (the compact form is what
    is pickled) or on the scheduler's rare failure path.
    """

    __slots__ = ("_expanded", "block_ids", "group_to_vllm_group", "planned")

    def __init__(
        self, planned: Sequence[PlannedBlock], block_ids: Sequence[int], group_to_vllm_group: Sequence[int]
    ) -> None:
        assert len(planned) == len(block_ids), f"{len(planned)} planned blocks but {len(block_ids)} block ids"
        self.planned = tuple(planned)
        self.block_ids = tuple(block_ids)
        self.group_to_vllm_group = tuple(group_to_vllm_group)
        self._expanded: tuple[BlockRef, ...] | None = None

    def _refs(self) -> tuple[BlockRef, ...]:
        if self._expanded is None:
            vllm_group_of = self.group_to_vllm_group
            self._expanded = tuple(
                BlockRef(
                    p.group_index,
                    vllm_group_of[p.group_index],
                    p.block_index,
                    bid,
                    p.block_hash,
                    p.key_boundary,
                )
                for p, bid in zip(self.planned, self.block_ids, strict=True)
            )
        return self._expanded

    def __len__(self) -> int:
        return len(self.block_ids)

    @overload
    def __getitem__(self, index: int) -> BlockRef: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[BlockRef, ...]: ...
    def __getitem__(self, index: int | slice) -> BlockRef | tuple[BlockRef, ...]:
        return self._refs()[index]

    def __iter__(self) -> Iterator[BlockRef]:
        return iter(self._refs())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlannedRefs({len(self)} blocks)"

    def __getstate__(self) -> tuple[tuple[PlannedBlock, ...], tuple[int, ...], tuple[int, ...]]:
        return self.planned, self.block_ids, self.group_to_vllm_group  # the compact form only

    def __setstate__(self, state: tuple[tuple[PlannedBlock, ...], tuple[int, ...], tuple[int, ...]]) -> None:
        self.planned, self.block_ids, self.group_to_vllm_group = state
        self._expanded = None


@dataclass(frozen=True)
class LoadJob:
    req_id: str
    boundary: int
    #: a tuple, or the scheduler's :class:`PlannedRefs` (expanded on first use)
    blocks: Sequence[BlockRef]
    #: layerwise mode, a declined hit (``blocks`` empty): the block ids vLLM allocated for its external
    #: tokens, reported as load errors so vLLM recomputes them (the one KV cache group's ids)
    declined_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveJob:
    job_id: int
    req_id: str
    #: a tuple, or the scheduler's :class:`PlannedRefs` (expanded on first use)
    blocks: Sequence[BlockRef]


@dataclass
class HybridStoreMetadata(KVConnectorMetadata):
    scheme: KeyScheme
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


class LoadResult(NamedTuple):
    """One planned entry of a load job, as one rank read it."""

    entry: EntryId
    outcome: LoadOutcome


class SaveResult(NamedTuple):
    """One entry of a save job, as one rank wrote it."""

    entry: EntryId
    outcome: SaveOutcome


@dataclass
class HybridStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """Results since the previous step, keyed by request (loads) and job (saves), lists over ranks.

    A load's results arrive in the step its rank reported the request in ``finished_recving``; a save
    job's results arrive no later than its rank's entry in ``saves_done``.
    """

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
        for req_id, load_results in other.loads.items():
            out.loads.setdefault(req_id, []).extend(load_results)
        for job_id, save_results in other.saves.items():
            out.saves.setdefault(job_id, []).extend(save_results)
        for job_id, ranks in other.saves_done.items():
            out.saves_done.setdefault(job_id, []).extend(ranks)
        return out

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.saves_done)
