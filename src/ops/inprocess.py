"""An in-process vLLM engine with ``HybridStoreConnector``: the product's own launcher.

``hybridkv describe`` (:mod:`hybridkv.ops.geometry`) runs a model on it to report the connector's view of the
geometry; the development kit (``hybridkv.demo.vllm_harness``), the benchmarks and the demo build on the
same functions.

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
    "connector_halves",
    "connector_transfer_config",
    "engine_kwargs",
    "inprocess_engine",
    "prepare_inprocess_environment",
]

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
    from hybridkv.connector.vllm_compat import this_process_connector

    # InprocClient: the engine core lives in this process.
    scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker_connector = this_process_connector()
    if not isinstance(scheduler_connector, HybridStoreConnector):
        raise TypeError(
            f"the engine's scheduler connector is {type(scheduler_connector).__name__}, not HybridStoreConnector"
        )
    if not isinstance(worker_connector, HybridStoreConnector):
        raise TypeError(
            f"the engine's worker connector is {type(worker_connector).__name__}, not HybridStoreConnector"
        )
    return scheduler_connector, worker_connector
