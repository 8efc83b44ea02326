"""No torn checksums: a full-attention tail saved while the next steps keep appending to it reads back OK.

The host path hands the store the KV pages themselves. A tail block saved under a boundary inside it
(key boundary not a multiple of the span) is still written by the following decode steps; if the store
checksums the page and copies it at different moments, the stored frame is torn and reads back
``CORRUPT``. ``faulty+...?delay_ms`` widens that window: the frame header (and its checksum) is built
before the wrapper's delay, the copy after it.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import BlockRef, HybridStoreMetadata, SaveJob
from hybridkv.connector.vllm_geometry import resolve_geometry
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.store import open_store
from hybridkv_dev.devkit.cluster import kv_cache_config

pytestmark = pytest.mark.vllm

NUM_SAVES = 4


def test_tail_saves_under_concurrent_decoding_never_read_back_corrupt(vllm_objs: dict[str, Any]) -> None:
    name = f"tail-{uuid.uuid4().hex[:8]}"
    vc, kvc = vllm_objs["vc"], kv_cache_config()
    ws = WorkerSide(
        vc,
        kvc,
        ConnectorConfig.from_extra_config({"store": f"faulty+memory://{name}?delay_ms=30"}, model="m"),
    )
    attn = torch.zeros(64, 1, 16, 64, dtype=torch.bfloat16)
    ws.register_kv_caches({"attn.0": attn, "mamba.0": torch.zeros(64, 1, 1, 256, dtype=torch.int8)})
    scheme = resolve_geometry(vc, kvc, "ns", check_vllm_sizes=True).scheme
    span = ws.geo.groups[0].span
    stop = threading.Event()
    try:
        expected = []
        for n in range(NUM_SAVES):
            block_id, key_hash = 10 + n, bytes([n + 1]) * 32
            boundary = 2 * span + span // 2  # inside block index 2: the tail of the prompt
            attn[block_id].fill_(float(n + 1))
            expected.append(attn[block_id].clone())
            job = SaveJob(n, "r", (BlockRef(0, 0, 2, block_id, key_hash, boundary),))
            ws.enqueue_saves(HybridStoreMetadata(scheme=scheme, saves=[job]))

            def decode(page: torch.Tensor = attn[block_id]) -> None:  # the next steps append to the block
                step = 0
                while not stop.is_set():
                    step += 1
                    page[:, 8:].fill_(float(100 + step % 100))  # exact in bfloat16: every write changes bytes

            stop.clear()
            writer = threading.Thread(target=decode)
            writer.start()
            assert ws.flush(10.0)
            stop.set()
            writer.join()
        store = open_store(f"memory://{name}")
        for n in range(NUM_SAVES):
            out = torch.empty_like(attn[0])
            status = store.get_into(
                [scheme.key(0, 0, bytes([n + 1]) * 32)], [out.view(torch.uint8).reshape(-1).numpy()]
            )
            assert status[0].is_ok, f"save {n} read back {status[0].value}: a torn checksum"
            assert torch.equal(out, expected[n]), f"save {n} stored bytes other than those at wait_for_save"
        assert ws.num_tail_snapshots == NUM_SAVES
    finally:
        stop.set()
        ws.shutdown()
