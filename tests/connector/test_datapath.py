"""``hybridkv.connector.datapath.movers``: block bytes through a real ``file://`` store, both paths, pool limits.

CPU tests run everywhere (the staged path is exercised on CPU tensors with unpinned slabs). The CUDA tests
run only on a GPU host.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hybridkv.connector.datapath.movers import (
    BlockMover,
    HostBufferPool,
    PinnedPool,
    StagingContext,
    block_mover,
    flatten_layers,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on GPU hosts only)")

N = 48  # blocks per cache


def _layers(device: str = "cpu", seed: int = 0) -> list[Any]:
    """Attention (bf16, one tensor), a Mamba layer as [conv, ssm] views of one raw storage (conv strided:
    non-contiguous pages), and a plain fp32 layer given as a one-element list."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.randn(N, 2, 16, 2, 32, generator=g).to(torch.bfloat16)
    raw = torch.randint(0, 256, (N, 4096), generator=g, dtype=torch.int32).to(torch.uint8)
    conv = raw[:, :192].view(torch.bfloat16).view(N, 3, 32).transpose(1, 2)  # (N, 32, 3), strided pages
    ssm = raw[:, 256:].view(torch.float32).view(N, 4, 8, 30)
    other = torch.randn(N, 3, 7, generator=g)  # odd page size: exercises slab alignment
    if device != "cpu":
        attn, raw, other = attn.to(device), raw.to(device), other.to(device)
        conv = raw[:, :192].view(torch.bfloat16).view(N, 3, 32).transpose(1, 2)
        ssm = raw[:, 256:].view(torch.float32).view(N, 4, 8, 30)
    assert not conv[0].is_contiguous() and ssm[0].is_contiguous()
    return [attn, [conv, ssm], [other]]


def _page_bytes(t: torch.Tensor, b: int) -> bytes:
    return bytes(t[b].contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _block_bytes(layers: list[Any], b: int) -> bytes:
    return b"".join(_page_bytes(t, b) for t in flatten_layers(layers))


def _staging(
    device: str, *, slab: int = 64 << 10, slabs: int = 2, stage: int = 4096, kernel: bool = False
) -> StagingContext:
    pool = PinnedPool(slab, slabs * slab, pin=device != "cpu")
    directions = frozenset({"save", "load"}) if kernel else frozenset()
    return StagingContext(device, pool, stage_bytes=stage, kernel_directions=directions)


def _copy_layers(device: str, copy: str) -> list[Any]:
    """``_layers``; for the copy kernel, only the layers it moves (whole 8-byte words per page: attention, and
    the Mamba SSM state, a view at an offset into its raw storage), as it declines a group with any other."""
    layers = _layers(device)
    return [layers[0], [layers[1][1]]] if copy == "kernel" else layers


def _round_trip(
    layers: list[Any], mover: BlockMover, store_url: str, private: HostBufferPool | None = None
) -> None:
    from hybridkv.store import open_store

    src, dst = [3, 17, 5, 40, 0], [9, 10, 47, 22, 31]
    want = [_block_bytes(layers, b) for b in src]
    keys = [f"k{b}" for b in src]
    with open_store(store_url) as store:
        sb = mover.gather(src, timeout=1, private=private)
        assert sb is not None
        with sb:
            assert [b"".join(bytes(p) for p in row) for row in sb.parts] == want
            assert all(s.is_ok for s in store.put(keys, sb.parts))
        before = [_block_bytes(layers, b) for b in dst]
        sb = mover.scatter_targets(dst, timeout=1, private=private)
        assert sb is not None
        statuses = store.get_into(keys[:4] + ["missing"], sb.parts)
        assert [s.is_ok for s in statuses] == [True, True, True, True, False]
        sb.commit([s.is_ok for s in statuses])
    for b_src, b_dst in zip(src[:4], dst[:4], strict=True):
        assert _block_bytes(layers, b_dst) == _block_bytes(layers, b_src)
    if mover.is_staged or private is not None:  # a block the store did not fill is left untouched
        assert _block_bytes(layers, dst[4]) == before[4]


@pytest.mark.parametrize("path", ["direct", "private", "staged", "staged-tiny-stage"])
def test_cpu_round_trip_through_file_store(tmp_path: Path, path: str) -> None:
    layers = _layers()
    staging = None
    if path == "staged":
        staging = _staging("cpu", stage=1 << 20)
    elif path == "staged-tiny-stage":
        staging = _staging("cpu", stage=256)  # raised to one page + alignment; many chunks per batch
    private = HostBufferPool(1 << 20) if path == "private" else None
    mover = block_mover(layers, staging=staging)
    assert mover.block_nbytes == len(_block_bytes(layers, 0))
    _round_trip(layers, mover, f"file://{tmp_path}/store", private)
    if private is not None:  # the save's buffer, given back, is the load's: allocated once
        assert (private.num_allocated, private.num_reused, private.num_idle) == (1, 1, 1)


def test_private_batches_copy_the_pages_into_pooled_buffers() -> None:
    """A private batch never aliases the pages (also the contiguous ones): its parts are a copy in a
    buffer of the pool, which the batch gives back on release; ``write`` copies only the flagged blocks."""
    layers = _layers()
    mover = block_mover(layers)
    pool = HostBufferPool(1 << 20)
    sb = mover.gather([7, 8], private=pool)
    assert sb is not None and sb.buffer is not None
    buffer = sb.buffer
    want = _block_bytes(layers, 7)
    for part in sb.parts[0]:
        part[:] = 0  # the copy, not the page
    assert _block_bytes(layers, 7) == want
    sb.release()
    assert sb.buffer is None and pool.num_idle == 1
    tgt = mover.scatter_targets([20, 21], private=pool)
    assert tgt is not None and tgt.buffer is buffer, "the idle buffer was not reused"
    before = [_block_bytes(layers, b) for b in (20, 21)]
    for row, b in zip(tgt.parts, (3, 4), strict=True):
        for part, t in zip(row, flatten_layers(layers), strict=True):
            part[:] = t[b].contiguous().reshape(-1).view(torch.uint8).numpy()
    assert [_block_bytes(layers, b) for b in (20, 21)] == before, "a private part aliases a page"
    tgt.write([False, True])
    assert _block_bytes(layers, 20) == before[0] and _block_bytes(layers, 21) == _block_bytes(layers, 4)
    tgt.commit([True, False])
    assert _block_bytes(layers, 20) == _block_bytes(layers, 3)
    assert (pool.num_allocated, pool.num_reused, pool.num_idle) == (1, 1, 1)


def test_direct_path_is_zero_copy_for_contiguous_pages() -> None:
    layers = _layers()
    mover = block_mover(layers)
    sb = mover.gather([7])
    assert sb is not None
    attn_part, conv_part, ssm_part, _ = sb.parts[0]
    attn_part[:] = 0  # writes through: the part is the page
    assert not layers[0][7].view(torch.uint8).any()
    ssm_part[:] = 1
    assert bool((layers[1][1][7].contiguous().view(torch.uint8) == 1).all())
    conv_part[:] = 0  # strided page: a staging copy, the cache is untouched until commit
    assert layers[1][0][7].contiguous().view(torch.uint8).any()
    tgt = mover.scatter_targets([7])
    assert tgt is not None
    tgt.parts[0][1][:] = 0
    tgt.commit()
    assert not layers[1][0][7].contiguous().view(torch.uint8).any()


def test_layout_and_batch_limit() -> None:
    layers = _layers()
    staging = _staging("cpu", slab=4 * 4096)
    mover = block_mover(layers, staging=staging)
    assert 1 <= mover.max_blocks <= staging.pool.slab_bytes // mover.block_nbytes
    with pytest.raises(ValueError, match="max_blocks"):
        mover.gather(list(range(mover.max_blocks + 1)))
    sb = mover.gather(list(range(mover.max_blocks)))
    assert sb is not None
    sb.release()
    with pytest.raises(ValueError, match="cannot hold one block"):
        block_mover(layers, staging=_staging("cpu", slab=1024))


def test_pool_exhaustion_returns_none_then_recovers() -> None:
    layers = _layers()
    staging = _staging("cpu", slabs=1)
    mover = block_mover(layers, staging=staging)
    held = mover.gather([1, 2])
    assert held is not None and staging.pool.in_use == 1
    t0 = time.monotonic()
    assert mover.gather([3], timeout=0.1) is None  # exhausted: gives up, reads nothing
    assert mover.scatter_targets([3], timeout=0) is None
    assert 0.09 <= time.monotonic() - t0 < 2.0
    assert staging.pool.allocated == 1  # never allocates beyond the budget

    # a waiter gets the slab as soon as it is released
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(mover.gather([4], timeout=5)))
    th.start()
    time.sleep(0.05)
    held.release()
    held.release()  # idempotent
    th.join(5)
    assert got and got[0] is not None
    assert bytes(got[0].parts[0][0]) == _page_bytes(layers[0], 4)
    got[0].release()
    assert staging.pool.in_use == 0 and staging.pool.allocated == 1  # reused, not reallocated


def test_commit_after_release_and_bad_flags() -> None:
    mover = block_mover(_layers(), staging=_staging("cpu"))
    sb = mover.scatter_targets([1, 2])
    assert sb is not None
    with pytest.raises(ValueError, match="flags"):
        sb.commit([True])
    assert mover.staging is not None and mover.staging.pool.in_use == 0  # released even on error
    with pytest.raises(RuntimeError):
        sb.commit()


def test_pool_accounting() -> None:
    pool = PinnedPool(1000, 2500, pin=False)
    assert pool.slab_bytes == 1024 and pool.max_slabs == 2 and pool.budget_bytes == 2048
    a, b = pool.acquire(), pool.acquire()
    assert a is not None and b is not None and pool.acquire() is None
    pool.release(a)
    assert pool.acquire() is a
    pool.close()
    with pytest.raises(RuntimeError):
        pool.acquire()
    assert PinnedPool(1 << 20, 10).max_slabs == 1  # at least one slab


def test_cuda_tensors_need_staging_and_one_device() -> None:
    with pytest.raises(ValueError, match="share one device"):
        block_mover([torch.zeros(4, 4), torch.zeros(4, 4, device="meta")])


# ------------------------------------------------------------------------------------------------ CUDA
@CUDA
@pytest.mark.parametrize("stage", [256, 1 << 20])
def test_cuda_round_trip_through_file_store(tmp_path: Path, stage: int) -> None:
    layers = _layers("cuda")
    staging = _staging("cuda", stage=stage)
    mover = block_mover(layers, staging=staging)
    assert staging.pool.pin
    sb = mover.gather([1])
    assert sb is not None
    assert sb.slab is not None and sb.slab.is_pinned()
    sb.release()
    _round_trip(layers, mover, f"file://{tmp_path}/store")
    with pytest.raises(ValueError, match="StagingContext"):
        block_mover(layers)


@CUDA
@pytest.mark.parametrize("copy", ["dma", "kernel"])
def test_cuda_gather_waits_for_the_fence(copy: str) -> None:
    """Writes queued on the compute stream before the fence are what the gather reads."""
    layers = _copy_layers("cuda", copy)
    mover = block_mover(layers, staging=_staging("cuda", slab=1 << 20, kernel=copy == "kernel"))
    assert mover.kernel_directions == ({"save", "load"} if copy == "kernel" else set()), (
        mover.kernel_unsupported
    )
    attn = layers[0]
    ids = [2, 30]
    compute = torch.cuda.Stream()
    for value in (1.0, 2.0, 3.0):
        with torch.cuda.stream(compute):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work before the write
            attn[ids] = value
            fence = mover.fence()
        assert fence is not None
        sb = mover.gather(ids, after=fence)
        assert sb is not None
        with sb:
            got = torch.from_numpy(np.array(sb.parts[1][0])).view(torch.bfloat16)
            assert bool((got == value).all()), value


@CUDA
@pytest.mark.parametrize("copy", ["dma", "kernel"])
def test_cuda_commit_is_complete_on_return_and_skips_failed_blocks(copy: str) -> None:
    layers = _copy_layers("cuda", copy)
    mover = block_mover(layers, staging=_staging("cuda", slab=1 << 20, stage=512, kernel=copy == "kernel"))
    assert mover.kernel_directions == ({"save", "load"} if copy == "kernel" else set()), (
        mover.kernel_unsupported
    )
    src = [4, 5, 6]
    want = [_block_bytes(layers, b) for b in src]
    before = _block_bytes(layers, 21)
    sb = mover.scatter_targets([20, 21, 22])
    assert sb is not None
    for row, value in zip(sb.parts, want, strict=True):
        pos = 0
        for p in row:
            p[:] = np.frombuffer(value[pos : pos + p.nbytes], dtype=np.uint8)
            pos += p.nbytes
    sb.commit([True, False, True])
    # read on another stream without a sync: the commit already waited for its copies
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _block_bytes(layers, 20) == want[0] and _block_bytes(layers, 22) == want[2]
        assert _block_bytes(layers, 21) == before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("stage", [256, 3000, 1 << 20])
def test_staged_batches_of_every_size_share_one_slab_layout(device: str, stage: int) -> None:
    """Any batch size, from one block to a full slab, with chunks from one page to the whole batch: the
    plan's pieces tile the batch and sit inside their chunk's copies, the bytes round-trip, and a slab's
    part views are built once and handed out again with its next batch."""
    layers = _layers(device)
    staging = _staging(device, slab=128 << 10, stage=stage)
    mover = block_mover(layers, staging=staging)
    assert mover.max_blocks >= 4
    cap = staging.chunk_bytes
    for n in sorted({1, 2, mover.max_blocks - 1, mover.max_blocks}):
        plan = mover.plan(n)
        tiled = [(p.tensor, r) for c in plan for p in c.pieces for r in range(p.r0, p.r1)]
        assert sorted(tiled) == [(k, r) for k in range(len(mover.tensors)) for r in range(n)]
        for chunk in plan:
            assert all(c.stage >= 0 and c.stage + c.nbytes <= cap for c in chunk.copies)
            for p in chunk.pieces:
                end = p.host + (p.r1 - p.r0) * mover.page_nbytes[p.tensor]
                assert p.stage % 256 == p.host % 256, p
                assert any(
                    c.host <= p.host and end <= c.host + c.nbytes and c.stage - c.host == p.stage - p.host
                    for c in chunk.copies
                ), (n, p)
        src = [(7 * i + 3) % N for i in range(n)]
        dst = [(src[-1] + 1 + i) % N for i in range(n)]
        want = [_block_bytes(layers, b) for b in src]
        sb = mover.gather(src)
        assert sb is not None
        with sb:
            got = [b"".join(bytes(p) for p in row) for row in sb.parts]
        assert got == want
        tgt = mover.scatter_targets(dst)
        assert tgt is not None
        for row, value in zip(tgt.parts, want, strict=True):
            pos = 0
            for p in row:
                p[:] = np.frombuffer(value[pos : pos + p.nbytes], dtype=np.uint8)
                pos += p.nbytes
        tgt.commit()
        assert [_block_bytes(layers, b) for b in dst] == want
    if stage == 1 << 20:  # a full slab is one contiguous run: one copy moves it
        assert [len(c.copies) for c in mover.plan(mover.max_blocks)] == [1]
    first = mover.gather([1, 2])
    assert first is not None
    first.release()
    second = mover.scatter_targets([3])
    assert second is not None
    assert second.parts[0][0] is first.parts[0][0]  # the same slab: the same views
    second.release()
