"""Real vLLM objects for connector tests: a ``VllmConfig`` (TP = DCP = 2) and a full + Mamba cache layout."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
from hybridkv.connector.tiny_models import build_tiny_model

MODELS = Path("/tmp/hybridkv-test-models")
HASH = 32  # full attention: 16 per rank x dcp 2; Mamba: 32


def make_vllm_objs() -> dict[str, Any]:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    # 1 KV head, 8 query heads: TP = DCP = 2 passes vLLM's validation.
    model = build_tiny_model("llama", MODELS, num_key_value_heads=1, num_attention_heads=8)
    store_name = f"dcp-{uuid.uuid4().hex[:8]}"
    vc = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True, seed=0),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store": f"memory://{store_name}", "lookup_budget_ms": 5000},
        ),
    )
    vc.cache_config.mamba_cache_mode = "align"
    vc.cache_config.num_gpu_blocks = 64
    return {"vc": vc, "store_url": f"memory://{store_name}"}


def kv_cache_config(num_blocks: int = 64) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=32, shapes=((2, 64),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * 2048, layers=["attn.0", "mamba.0"], layer_stride=0, block_stride=2048
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], full), KVCacheGroupSpec(["mamba.0"], mamba)],
    )
    cfg.hash_block_size = HASH
    cfg.cache_hit_alignment_tokens = HASH
    return cfg
