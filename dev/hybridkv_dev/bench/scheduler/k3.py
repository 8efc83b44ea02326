"""The Kimi-K3-like geometry the scheduler bench runs at: vLLM configs, the scheduler, its requests, a store's
saved prefix."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridkv.demo.tiny_models import build_tiny_model

K3_BLOCK = 64
K3_DCP = 8
_MAX_MODEL_LEN = 131072 + 1024
_CHUNK = 8192  # saved Mamba states: one per prefill chunk end
_PUT_BATCH = 512  # keys per put while filling the store (a remote store's deadline bounds one call)
#: the peer's ``lookup_prefetch_limit`` in its prefetch mode: every request of a default stream at once
PEER_PREFETCH_LIMIT = 64


def peer_modes() -> list[tuple[str, bool, int]]:
    """The peer's modes on the installed vLLM: (name, ``lookup_async``, ``lookup_prefetch_limit``). Lookup
    prefetch came with vLLM 0.34."""
    from hybridkv.connector.vllm_compat import vllm_release

    modes = [("sync", False, 0), ("async", True, 0)]
    if vllm_release() >= (0, 34):
        modes.append(("async+prefetch", True, PEER_PREFETCH_LIMIT))
    return modes


def k3_configs(
    store_url: str | None, models_dir: Path, *, num_blocks: int = 8192, transfer: Any = None
) -> tuple[Any, Any]:
    """(VllmConfig, scheduler KVCacheConfig): MLA block 64 x DCP 8 + Mamba align block 64, TP 8.

    ``store_url``: hybridkv's connector on that store; None: no connector, or ``transfer`` (another
    connector's ``KVTransferConfig``, e.g. the peer's). Everything else is vLLM's default
    (``lookup_budget_ms`` too).
    """
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
    )

    model = build_tiny_model(
        "llama",
        models_dir,
        num_key_value_heads=1,
        num_attention_heads=8,
        max_position_embeddings=_MAX_MODEL_LEN,
    )
    if store_url is not None:
        transfer = KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store": store_url, "namespace": "k3"},
        )
    vc = VllmConfig(
        model_config=ModelConfig(
            model=str(model),
            dtype="bfloat16",
            skip_tokenizer_init=True,
            seed=0,
            max_model_len=_MAX_MODEL_LEN,
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=K3_DCP, decode_context_parallel_size=K3_DCP),
        cache_config=CacheConfig(block_size=K3_BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_model_len=_MAX_MODEL_LEN,
            max_num_batched_tokens=_CHUNK,
            max_num_seqs=64,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
    )
    vc.cache_config.mamba_cache_mode = "align"
    vc.cache_config.num_gpu_blocks = num_blocks
    mla = MLAAttentionSpec(
        block_size=K3_BLOCK, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, cache_dtype_str="auto"
    )
    mamba = MambaSpec(
        block_size=K3_BLOCK, shapes=((4,), (8,)), dtypes=(torch.int16, torch.int32), mamba_cache_mode="align"
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * 4096, layers=["attn.0", "ssm.0"], layer_stride=0, block_stride=4096
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["attn.0"], mla), KVCacheGroupSpec(["ssm.0"], mamba)],
    )
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(cfg, vc)
    cfg.hash_block_size = hash_bs
    cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(cfg, vc, sched_bs, hash_bs)
    return vc, cfg


def k3_scheduler(
    store_url: str | None, models_dir: Path, *, transfer: Any = None, extra: Mapping[str, Any] | None = None
) -> Any:
    """vLLM's real ``Scheduler`` over ``k3_configs`` (no workers); ``extra``: more of hybridkv's
    ``kv_connector_extra_config``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc, cfg = k3_configs(store_url, models_dir, transfer=transfer)
    if extra and store_url is not None:
        vc.kv_transfer_config.kv_connector_extra_config.update(extra)
    return Scheduler(
        vc,
        cfg,
        StructuredOutputManager(vc),
        block_size=cfg.hash_block_size,
        hash_block_size=cfg.hash_block_size,
    )


def k3_request(request_id: str, family: int, num_tokens: int) -> Any:
    """A request whose prompt is the first ``num_tokens`` tokens of ``family`` (families share nothing)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    rng = random.Random(family)
    tokens = [rng.randrange(3, 30000) for _ in range(num_tokens)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return Request(request_id, tokens, sp, None, block_hasher=get_request_block_hasher(K3_BLOCK, sha256))


def saved_entries(num_tokens: int, unit: int, span: int) -> list[tuple[int, int]]:
    """(KV-cache group, boundary in tokens) of what a previous request of ``num_tokens`` tokens saved: group 0
    (MLA) at every ``span`` end, group 1 (Mamba) at every chunk end and at its last hash unit."""
    entries = [(0, b) for b in range(span, num_tokens + 1, span)]
    states = sorted({*range(_CHUNK, num_tokens + 1, _CHUNK), num_tokens - num_tokens % unit})
    return entries + [(1, b) for b in states if b > 0]


def store_prefix(scheme: Any, store: Any, block_hashes: Sequence[bytes], num_tokens: int) -> int:
    """Write what a previous request of ``num_tokens`` tokens saved (``saved_entries``) on every rank.
    Returns the number of keys written."""
    geometry = scheme.geometry
    ranks = [r.tp_rank for r in geometry.topology.ranks]
    entries = saved_entries(num_tokens, geometry.hash_unit, geometry.spans[0])
    keys = [scheme.key(g, r, scheme.boundary_hash(block_hashes, b)) for g, b in entries for r in ranks]
    for start in range(0, len(keys), _PUT_BATCH):
        batch = keys[start : start + _PUT_BATCH]
        statuses = store.put(batch, [b"k3"] * len(batch))
        assert all(s.is_ok for s in statuses), f"bench put failed: {set(statuses)}"
    return len(keys)


def full_scan_hit(scheme: Any, store: Any, request: Any) -> int:
    """The synchronous full scan's answer (every candidate key in one ``exists``): the old lookup."""
    from hybridkv.lifecycle.lookup import plan_lookup

    candidates = plan_lookup(scheme, request.block_hashes, request.num_tokens, 0)
    exists = [s.is_ok for s in store.exists(list(candidates.keys))] if candidates.keys else []
    return candidates.resolve(exists).num_external_tokens
