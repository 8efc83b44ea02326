"""Engine steps and config builders over the in-process engine, shared by the tests, benchmarks and demo.

The engine itself (``inprocess_engine``, ``connector_halves``, ``connector_transfer_config``,
``engine_kwargs``, ``prepare_inprocess_environment``) is the product's :mod:`hybridkv.ops.inprocess`
(``hybridkv describe`` runs on it). Here: config builders for the connector's halves without an engine
(``connector_vllm_config``, ``resolve_cache_block_sizes``, ``block_hashed_request``) and the steps every
caller of an engine needs: a greedy request, settling queued saves, dropping vLLM's device prefix cache
while keeping the store. vLLM is imported only inside the functions; nothing here configures logging.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridkv.ops.inprocess import connector_halves, connector_transfer_config

__all__ = [
    "block_hashed_request",
    "connector_vllm_config",
    "drop_local_cache",
    "greedy",
    "resolve_cache_block_sizes",
    "settle",
]

#: A short prompt that steps the engine (shorter than a block: no block hashes, no lookups, no saves).
PUMP_PROMPT = [5, 6, 7]


def connector_vllm_config(
    model_dir: Path,
    extra: Mapping[str, Any],
    *,
    block_size: int,
    num_blocks: int,
    tp: int = 1,
    dcp: int = 1,
    mamba_align: bool = False,
) -> Any:
    """A CPU ``VllmConfig`` over ``model_dir`` with prefix caching on and ``HybridStoreConnector`` on
    ``extra`` (``connector_transfer_config``), for the connector's halves without an engine: TP ``tp``, DCP
    ``dcp``, ``num_blocks`` device blocks of ``block_size`` tokens; ``mamba_align``: Mamba state cached in
    vLLM's align mode."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, seed=0),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=connector_transfer_config(extra),
    )
    if mamba_align:
        vllm_config.cache_config.mamba_cache_mode = "align"
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return vllm_config


def resolve_cache_block_sizes(kv_cache_config: Any, vllm_config: Any) -> None:
    """Set ``kv_cache_config``'s hash block size and hit alignment the way vLLM's engine does (its own
    functions), so the connector sees what a real engine would give it."""
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes

    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )


def block_hashed_request(
    request_id: str, tokens: list[int], hash_unit: int, max_tokens: int = 1, *, hash_lookahead: int = 0
) -> Any:
    """A greedy ``vllm.v1.request.Request`` of ``tokens`` with vLLM's own block hasher (sha256, blocks of
    ``hash_unit`` tokens; vLLM 0.34's ``hash_lookahead`` tokens past each block in its hash, 0: none), as
    the engine builds it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    make_hasher: Any = get_request_block_hasher  # its third parameter (lookahead) exists from vLLM 0.34 on
    hasher = (
        make_hasher(hash_unit, sha256, hash_lookahead)
        if hash_lookahead
        else get_request_block_hasher(hash_unit, sha256)
    )
    return Request(request_id, list(tokens), params, None, block_hasher=hasher)


def greedy(llm: Any, tokens: list[int], max_tokens: int, *, cache_salt: str | None = None) -> Any:
    """One greedy request of ``tokens`` (``ignore_eos``, vLLM's ``cache_salt`` if given); its ``RequestOutput``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request: dict[str, Any] = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    return llm.generate([request], params, use_tqdm=False)[0]


def settle(llm: Any, max_steps: int = 50) -> None:
    """Let queued saves finish: the worker writes them, the scheduler sees the results (pins released, save
    waves terminal). Steps the engine with ``PUMP_PROMPT`` while push work is pending; ``RuntimeError``
    after ``max_steps`` steps."""
    from vllm import SamplingParams

    scheduler_connector, worker_connector = connector_halves(llm)
    for _ in range(max_steps):
        worker_connector.worker_side.flush()
        if not scheduler_connector.scheduler_side.has_pending_push_work():
            return
        llm.generate(
            [{"prompt_token_ids": PUMP_PROMPT}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
        )
    raise RuntimeError(f"connector still has pending saves after {max_steps} engine steps")


def drop_local_cache(llm: Any, attempts: int = 20) -> None:
    """Empty vLLM's device prefix cache and keep the external store (``reset_connector=False``); saves are
    settled first so their source blocks are no longer pinned. ``RuntimeError`` when vLLM refuses
    ``attempts`` times."""
    for _ in range(attempts):
        settle(llm)
        if llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
            return
    raise RuntimeError(f"vLLM refused to reset its prefix cache {attempts} times (blocks still in use)")
