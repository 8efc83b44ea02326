"""The copy kernel (``hybridkv.connector.datapath.copy_kernels``) moves exactly what the ``index_select`` path moves,
straight between pages and slab and as the DMA path's packing of staging chunks.

The kernel runs here on CPU tensors under Triton's interpreter, in a child process: ``TRITON_INTERPRET`` must
be set before Triton compiles the kernel, and must not leak into this process's other Triton users.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Triton 3.6's interpreter cannot run the kernel's unspecialized loop bounds (its CUDA path can); 3.9 can.
pytest.importorskip("triton", minversion="3.9")

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from hybridkv.connector.datapath.movers import PinnedPool, StagingContext, block_mover

    torch.manual_seed(0)
    num_blocks = 12
    # vLLM-like layers: views into one buffer (storage offsets), two page sizes, bf16 and fp32
    base = torch.randint(-(1 << 15), (1 << 15) - 1, (num_blocks * 2 * 128 + 16,), dtype=torch.int16)
    layers = [
        base[16 : 16 + num_blocks * 128].view(torch.bfloat16).view(num_blocks, 2, 8, 8),
        base[16 + num_blocks * 128 : 16 + num_blocks * 256].view(torch.bfloat16).view(num_blocks, 2, 8, 8),
        torch.randn(num_blocks, 48, dtype=torch.float32),
    ]
    mamba_raw = torch.empty(num_blocks, 512, dtype=torch.uint8).random_(0, 255)
    conv = mamba_raw[:, :192].view(torch.bfloat16).view(num_blocks, 3, 32).transpose(1, 2)
    ssm = mamba_raw[:, 192:].view(torch.float32).view(num_blocks, 80)
    out = {}

    def mover(ls, kernel, pack=True):
        dirs = frozenset({"save", "load"}) if kernel else frozenset()
        ctx = StagingContext("cpu", PinnedPool(1 << 16, 1 << 16, pin=False), stage_bytes=1024,
                             kernel_directions=dirs, pack_by_kernel=pack)
        return block_mover(ls, staging=ctx)

    for name, ls in (("attn", layers), ("mamba", [[conv, ssm]])):
        # the kernel straight to the slab; DMA with chunks packed by the kernel; DMA packed by index_select
        k, d, x = mover(ls, True), mover(ls, False), mover(ls, False, pack=False)
        out[name + "_kernel_directions"] = sorted(k.kernel_directions)
        out[name + "_unsupported"] = k.kernel_unsupported
        out[name + "_packs_by_kernel"] = [k.packs_by_kernel, d.packs_by_kernel, x.packs_by_kernel]
        # 1024-byte staging: several chunks per batch, pieces split at the chunks' ends (1-3 launches each)
        out[name + "_chunks"] = len(d.plan(5))
        src = [7, 2, 9, 0, 5]
        ref = x.gather(src)
        gathered = [[bytes(p) for p in row] for row in ref.parts]
        ref.release()
        out[name + "_gather_equal"] = []
        out[name + "_scatter_ok"] = []
        for m in (k, d):
            a = m.gather(src)
            out[name + "_gather_equal"].append(
                [[bytes(p) for p in row] for row in a.parts] == gathered and len(a.parts) == len(src)
            )
            a.release()
        dst, keep = [1, 11, 3, 4, 8], [True, False, True, True, False]
        tensors = k.tensors
        for m in (k, d, x):
            for t in tensors:
                for i in dst:
                    t[i].zero_() if t[i].is_contiguous() else t[i].copy_(torch.zeros_like(t[i]))
            before = [[bytes(t[i].contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors] for i in dst]
            sb = m.scatter_targets(dst)
            for row, want in zip(sb.parts, gathered):
                for part, w in zip(row, want):
                    part[:] = bytearray(w)
            sb.commit(keep)
            sb.release()
            after = [[bytes(t[i].contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors] for i in dst]
            out[name + "_scatter_ok"].append(
                all(after[r] == (gathered[r] if keep[r] else before[r]) for r in range(len(dst)))
            )
            out[name + "_dropped_differ"] = all(gathered[r] != before[r] for r in range(len(dst)))
    print(json.dumps(out))
    """
)


def test_copy_kernel_matches_dma_path_and_skips_dropped_blocks() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # attention-like pages: the kernel takes both directions and moves the same bytes as packing + DMA
    assert out["attn_kernel_directions"] == ["load", "save"], out
    assert out["attn_unsupported"] is None, out
    # ... and packs the DMA path's staging chunks (several chunks, pieces split at their ends)
    assert out["attn_packs_by_kernel"] == [True, True, False], out
    assert out["attn_chunks"] >= 3, out
    # every path moves the bytes the index_select path moves, and writes only the kept blocks
    assert out["attn_gather_equal"] == [True, True] and out["attn_scatter_ok"] == [True, True, True], out
    # a Mamba layer's conv state is a strided view: the kernel declines, the DMA path moves it by index
    assert out["mamba_kernel_directions"] == [], out
    assert out["mamba_packs_by_kernel"] == [False, False, False], out
    assert "strided pages" in out["mamba_unsupported"], out
    assert out["mamba_gather_equal"] == [True, True] and out["mamba_scatter_ok"] == [True, True, True], out
    # the check can fail: the blocks left out of the commit would have changed
    assert out["attn_dropped_differ"] and out["mamba_dropped_differ"], out


def test_cuda_copy_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel`` without Triton stops the engine at start naming the key; ``auto`` packs its DMA chunks by
    ``index_select`` instead of the kernel; ``dma`` never asks for Triton."""
    from hybridkv.connector.worker.context import kernel_directions, packs_by_kernel

    assert kernel_directions("auto") == frozenset() and packs_by_kernel("auto")
    assert kernel_directions("kernel") == {"save", "load"} and packs_by_kernel("kernel")
    assert kernel_directions("dma") == frozenset() and not packs_by_kernel("dma")
    monkeypatch.delitem(sys.modules, "hybridkv.connector.datapath.copy_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now raises ImportError
    with pytest.raises(ValueError, match=r"\['cuda_copy'\]: 'kernel' needs Triton"):
        kernel_directions("kernel")
    assert kernel_directions("auto") == frozenset() and not packs_by_kernel("auto")
    assert not packs_by_kernel("dma")


def test_a_kernel_that_fails_to_build_leaves_the_dma_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton that cannot compile the kernel (or any other failure building it) must not stop the engine:
    the group takes the DMA path and says why."""
    import torch
    from hybridkv.connector.datapath import copy_kernels
    from hybridkv.connector.datapath.movers import PinnedPool, StagingContext, block_mover

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("compile failed: no such PTX version")

    monkeypatch.setattr(copy_kernels, "KernelCopier", broken)
    staging = StagingContext(
        "cpu", PinnedPool(1 << 16, 1 << 16, pin=False), kernel_directions=frozenset({"save", "load"})
    )
    layer = torch.arange(8 * 64, dtype=torch.int64).view(8, 64)
    mover = block_mover([layer], staging=staging)
    assert mover.kernel_directions == frozenset()
    assert "compile failed" in (mover.kernel_unsupported or "")
    sb = mover.gather([5, 1])
    assert sb is not None
    with sb:
        assert bytes(sb.parts[0][0]) == layer[5].numpy().tobytes()
        assert bytes(sb.parts[1][0]) == layer[1].numpy().tobytes()
