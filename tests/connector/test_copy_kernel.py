"""The one-launch copy kernel (``hybridkv.connector.copy_kernels``) moves exactly what the DMA path moves.

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
    from hybridkv.connector.datapath import BlockMover, PinnedPool, StagingContext

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

    def mover(ls, kernel):
        dirs = frozenset({"save", "load"}) if kernel else frozenset()
        ctx = StagingContext("cpu", PinnedPool(1 << 16, 1 << 16, pin=False), stage_bytes=4096,
                             kernel_directions=dirs)
        return BlockMover(ls, staging=ctx)

    for name, ls in (("attn", layers), ("mamba", [[conv, ssm]])):
        k, d = mover(ls, True), mover(ls, False)
        out[name + "_kernel_directions"] = sorted(k.kernel_directions)
        out[name + "_unsupported"] = k.kernel_unsupported
        src = [7, 2, 9, 0, 5]
        a, b = k.gather(src), d.gather(src)
        out[name + "_gather_equal"] = all(
            bytes(x) == bytes(y) for ra, rb in zip(a.parts, b.parts) for x, y in zip(ra, rb)
        ) and len(a.parts) == len(src)
        gathered = [[bytes(x) for x in row] for row in a.parts]
        a.release(); b.release()
        dst, keep = [1, 11, 3, 4, 8], [True, False, True, True, False]
        tensors = k.tensors
        before = [[bytes(t[i].contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors] for i in dst]
        sb = k.scatter_targets(dst)
        for row, want in zip(sb.parts, gathered):
            for part, w in zip(row, want):
                part[:] = bytearray(w)
        sb.commit(keep)
        sb.release()
        after = [[bytes(t[i].contiguous().view(torch.uint8).reshape(-1).numpy()) for t in tensors] for i in dst]
        out[name + "_scatter_ok"] = all(
            after[r] == (gathered[r] if keep[r] else before[r]) for r in range(len(dst))
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
    assert out["attn_gather_equal"] and out["attn_scatter_ok"], out
    # a Mamba layer's conv state is a strided view: the kernel declines, the DMA path moves it
    assert out["mamba_kernel_directions"] == [], out
    assert "strided pages" in out["mamba_unsupported"], out
    assert out["mamba_gather_equal"] and out["mamba_scatter_ok"], out
    # the check can fail: the blocks left out of the commit would have changed
    assert out["attn_dropped_differ"] and out["mamba_dropped_differ"], out


def test_cuda_copy_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel`` without Triton stops the engine at start naming the key; ``auto`` falls back to DMA."""
    from hybridkv.connector.worker_context import kernel_directions

    assert kernel_directions("auto") == {"load"}
    assert kernel_directions("kernel") == {"save", "load"}
    assert kernel_directions("dma") == frozenset()
    monkeypatch.delitem(sys.modules, "hybridkv.connector.copy_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" now raises ImportError
    with pytest.raises(ValueError, match=r"\['cuda_copy'\]: 'kernel' needs Triton"):
        kernel_directions("kernel")
    assert kernel_directions("auto") == frozenset()


def test_a_kernel_that_fails_to_build_leaves_the_dma_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton that cannot compile the kernel (or any other failure building it) must not stop the engine:
    the group takes the DMA path and says why."""
    import torch
    from hybridkv.connector import copy_kernels
    from hybridkv.connector.datapath import BlockMover, PinnedPool, StagingContext

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("compile failed: no such PTX version")

    monkeypatch.setattr(copy_kernels, "KernelCopier", broken)
    staging = StagingContext(
        "cpu", PinnedPool(1 << 16, 1 << 16, pin=False), kernel_directions=frozenset({"save", "load"})
    )
    layer = torch.arange(8 * 64, dtype=torch.int64).view(8, 64)
    mover = BlockMover([layer], staging=staging)
    assert mover.kernel_directions == frozenset()
    assert "compile failed" in (mover.kernel_unsupported or "")
    sb = mover.gather([5, 1])
    assert sb is not None
    with sb:
        assert bytes(sb.parts[0][0]) == layer[5].numpy().tobytes()
        assert bytes(sb.parts[1][0]) == layer[1].numpy().tobytes()
