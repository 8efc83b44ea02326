"""An in-process vLLM engine with ``HybridStoreConnector``, shared by the tests, the benchmarks and the demo.

Config builders (``connector_transfer_config``, ``engine_kwargs`` for an engine; ``connector_vllm_config``,
``resolve_cache_block_sizes`` and ``block_hashed_request`` for the connector's halves without one) and an engine whose two connector halves
(scheduler-role and worker-role ``HybridStoreConnector``) are reachable from this process, with the steps
every caller needs: a greedy request, settling queued saves, dropping vLLM's device prefix cache while
keeping the store.

Contracts:

- The engine must run in-process: ``prepare_inprocess_environment()`` sets
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM is imported (the other variables only when unset).
- vLLM is imported only inside the functions, so importing this module is cheap.
- Nothing here configures logging.
"""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.connector.connector import HybridStoreConnector

__all__ = [
    "block_hashed_request",
    "connector_halves",
    "connector_transfer_config",
    "connector_vllm_config",
    "drop_local_cache",
    "engine_kwargs",
    "greedy",
    "inprocess_engine",
    "prepare_inprocess_environment",
    "resolve_cache_block_sizes",
    "settle",
]

#: A short prompt that steps the engine (shorter than a block: no block hashes, no lookups, no saves).
PUMP_PROMPT = [5, 6, 7]

_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def prepare_inprocess_environment(vllm_log_level: str | None = None, *, quiet: bool = False) -> None:
    """In-process vLLM (forced), offline, no telemetry. ``vllm_log_level``: the default of
    ``VLLM_LOGGING_LEVEL``; ``quiet``: vLLM's log on stderr, no progress bars, no deprecation chatter from
    vLLM's own modules. Values the user already set win, except multiprocessing."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in _OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if vllm_log_level is not None:
        level = os.environ.setdefault("VLLM_LOGGING_LEVEL", vllm_log_level)
        # Some vLLM modules log while it is still importing, before its own logging config applies.
        logging.getLogger("vllm").setLevel(getattr(logging, level.upper(), logging.ERROR))
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("TQDM_DISABLE", "1")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")


def connector_transfer_config(extra: Mapping[str, Any], *, module_path: bool = True) -> Any:
    """vLLM's ``KVTransferConfig`` for ``HybridStoreConnector`` with ``extra`` as its
    ``kv_connector_extra_config`` (failed loads recomputed). ``module_path=False`` names the connector only,
    relying on the ``hybridkv`` vLLM plugin entry point."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="HybridStoreConnector",
        kv_connector_module_path="hybridkv.connector" if module_path else None,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra),
    )


def engine_kwargs(
    *,
    max_model_len: int = 2048,
    kv_cache_bytes: int = 64 << 20,
    dtype: str = "bfloat16",
    max_num_seqs: int = 4,
) -> dict[str, Any]:
    """``LLM(...)`` arguments for a tiny model on CPU: token ids in (no tokenizer), eager, seeded, a whole
    prompt of up to ``max_model_len`` tokens prefilled in one step."""
    return {
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_model_len,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "enforce_eager": True,
        "seed": 0,
    }


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


def block_hashed_request(request_id: str, tokens: list[int], hash_unit: int, max_tokens: int = 1) -> Any:
    """A greedy ``vllm.v1.request.Request`` of ``tokens`` with vLLM's own block hasher (sha256, blocks of
    ``hash_unit`` tokens), as the engine builds it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(
        request_id, list(tokens), params, None, block_hasher=get_request_block_hasher(hash_unit, sha256)
    )


@contextmanager
def inprocess_engine(
    model_dir: Path, transfer: Any, *, prefix_caching: bool = True, **kwargs: Any
) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` over ``model_dir`` with ``transfer`` (a ``KVTransferConfig`` or None);
    ``kwargs`` default to ``engine_kwargs()``. The engine core is shut down on exit (the connector flushes
    its saves and closes its audit log)."""
    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        enable_prefix_caching=prefix_caching,
        kv_transfer_config=transfer,
        **(engine_kwargs() | kwargs),
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def connector_halves(llm: Any) -> tuple[HybridStoreConnector, HybridStoreConnector]:
    """(scheduler-role, worker-role) ``HybridStoreConnector`` of an in-process engine; ``TypeError`` when the
    engine runs another connector."""
    from hybridkv.connector.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    # InprocClient: the engine core lives in this process.
    scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker_connector = get_kv_transfer_group()
    if not isinstance(scheduler_connector, HybridStoreConnector):
        raise TypeError(
            f"the engine's scheduler connector is {type(scheduler_connector).__name__}, not HybridStoreConnector"
        )
    if not isinstance(worker_connector, HybridStoreConnector):
        raise TypeError(
            f"the engine's worker connector is {type(worker_connector).__name__}, not HybridStoreConnector"
        )
    return scheduler_connector, worker_connector


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
