"""Helpers for in-process vLLM engines with HybridStoreConnector (CPU build, tiny random models).

A thin layer over :mod:`hybridkv.demo.vllm_harness` (the engine the benchmarks and the demo use too).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR
from hybridkv.ops import inprocess

inprocess.prepare_inprocess_environment()

MODELS_DIR = DEFAULT_MODELS_DIR


def prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@contextmanager
def engine(model_dir: Path, extra: dict[str, Any], *, module_path: bool = True) -> Iterator[Any]:
    """An in-process ``LLM`` with the connector; shut down (worker saves flushed) on exit.

    ``module_path=False`` names the connector only, relying on the ``hybridkv`` vLLM plugin entry point.
    """
    transfer = inprocess.connector_transfer_config(extra, module_path=module_path)
    with inprocess.inprocess_engine(model_dir, transfer) as llm:
        yield llm


def generate(
    llm: Any, tokens: list[int], max_tokens: int = 8, *, cache_salt: str | None = None
) -> tuple[list[int], int]:
    """Greedy output tokens and ``num_cached_tokens`` of one prompt (with vLLM's ``cache_salt`` if given)."""
    out = vllm_harness.greedy(llm, tokens, max_tokens, cache_salt=cache_salt)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def connectors(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role, worker-role) connector objects of an in-process engine."""
    return inprocess.connector_halves(llm)


def flush_saves(llm: Any) -> None:
    """Wait until the worker wrote every queued save and the scheduler saw the results."""
    vllm_harness.settle(llm)


def reset_local_cache(llm: Any) -> None:
    """Drop vLLM's device prefix cache (not the store); pins of in-flight saves are released first."""
    vllm_harness.drop_local_cache(llm)


def audit(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
