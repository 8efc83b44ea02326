"""A ``WorkerSide`` over the session's vLLM objects with two random KV caches (full attention + a raw
Mamba state page), and waiting for its loads."""

from __future__ import annotations

import time
from typing import Any

import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker.side import WorkerSide
from hybridkv_dev.devkit.cluster import kv_cache_config


def make_worker(
    vllm_objs: dict[str, Any], store: str, **extra: Any
) -> tuple[WorkerSide, dict[str, torch.Tensor], Any]:
    vc = vllm_objs["vc"]
    kvc = kv_cache_config()
    cfg = ConnectorConfig.from_extra_config({"store": store, **extra}, model="m")
    ws = WorkerSide(vc, kvc, cfg)
    gen = torch.Generator().manual_seed(0)
    caches = {
        "attn.0": torch.randn(64, 1, 16, 64, generator=gen).to(torch.bfloat16),  # K|V on the last dim
        "mamba.0": torch.randint(
            -128, 127, (64, 1, 1, 256), generator=gen, dtype=torch.int8
        ),  # raw state page
    }
    ws.register_kv_caches(caches)
    scheme = resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).scheme
    return ws, caches, scheme


def wait_loads(ws: WorkerSide, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = ws.transfer_results()
        if done:
            return done, failed
        time.sleep(0.01)
    raise AssertionError("load never finished")
