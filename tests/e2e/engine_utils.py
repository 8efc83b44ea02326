"""Helpers for in-process vLLM engines with HybridStoreConnector (CPU build, tiny random models)."""

from __future__ import annotations

import gc
import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

MODELS_DIR = Path(os.environ.get("HYBRIDKV_TEST_MODELS", "/tmp/hybridkv-test-models"))


def prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@contextmanager
def engine(model_dir: Path, extra: dict[str, Any], *, module_path: bool = True) -> Iterator[Any]:
    """An in-process ``LLM`` with the connector; shut down (worker saves flushed) on exit.

    ``module_path=False`` names the connector only, relying on the ``hybridkv`` vLLM plugin entry point.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector" if module_path else None,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(
    llm: Any, tokens: list[int], max_tokens: int = 8, *, cache_salt: str | None = None
) -> tuple[list[int], int]:
    """Greedy output tokens and ``num_cached_tokens`` of one prompt (with vLLM's ``cache_salt`` if given)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request: dict[str, Any] = {"prompt_token_ids": tokens}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    out = llm.generate([request], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role, worker-role) connector objects of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


def flush_saves(llm: Any) -> None:
    """Wait until the worker wrote every queued save, then let the scheduler see the results."""
    _, worker = connectors(llm)
    worker.worker_side.flush()


def reset_local_cache(llm: Any) -> None:
    """Drop vLLM's device prefix cache (not the store); pins of in-flight saves must be released first."""
    from vllm import SamplingParams

    flush_saves(llm)
    for _ in range(20):
        if llm.reset_prefix_cache():
            return
        # One tiny request steps the engine so the scheduler receives the save results and unpins.
        llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
        flush_saves(llm)
    raise AssertionError("device prefix cache could not be reset (blocks still pinned)")


def audit(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
