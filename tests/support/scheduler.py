"""vLLM's real ``Scheduler`` with the connector (no workers) over ``hybridkv_dev.devkit.cluster``'s KV-cache
config (TP = DCP = 2, full attention + Mamba), and what the scheduler-level tests hand it: requests, store
contents under the connector's keys, the executor's aggregated worker output; ``tokens``: random prompts;
``mtp_draft_config``: the config of a multi-module MTP draft for a real ``SpeculativeConfig``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hybridkv.demo.tiny_models import tiny_config_kwargs
from hybridkv_dev.devkit.cluster import HASH
from hybridkv_dev.devkit.cluster import kv_cache_config as _kv_cache_config

#: The prompt length of the scheduler-matrix tests.
PROMPT = 300

#: For a test taking the connector tests' ``objs`` fixture: run it with the lookups on a thread (a
#: ``memory://`` store) and in a lookup process (``lookup_process: true`` over a ``file://`` store).
both_lookup_modes = pytest.mark.parametrize("objs", ["thread", "process"], indirect=True)


def make_scheduler(vc: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(vc, _kv_cache_config(), StructuredOutputManager(vc), block_size=32, hash_block_size=HASH)


def make_request(rid: str, n: int, first: int = 10) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=4, temperature=0)
    sp.update_from_generation_config({}, eos_token_id=None) if hasattr(
        sp, "update_from_generation_config"
    ) else None
    return Request(
        rid, list(range(first, first + n)), sp, None, block_hasher=get_request_block_hasher(HASH, sha256)
    )


def fill_store(
    scheme: Any, store: Any, hashes: list[bytes], entries: list[tuple[int, int]], ranks: tuple[int, ...]
) -> list[str]:
    keys = [scheme.key(g, r, hashes[b // HASH - 1]) for g, b in entries for r in ranks]
    assert all(s.is_ok for s in store.put(keys, [b"x"] * len(keys)))
    return keys


def model_output(sched_out: Any, worker_meta: Any, finished: set[str], failed: set[str]) -> Any:
    from hybridkv_dev.devkit.cluster import model_runner_output
    from vllm.v1.outputs import KVConnectorOutput

    return model_runner_output(
        [],
        kv_connector_output=KVConnectorOutput(
            finished_recving=finished, failed_recving=failed, kv_connector_worker_meta=worker_meta
        ),
    )


def tokens(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


#: Per MTP draft family: the architecture its config names (vLLM's MTP override reads the model type).
_MTP_ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def mtp_draft_config(family: str, out_dir: Path, *, n_predict: int, **overrides: Any) -> Path:
    """Write the ``config.json`` of a tiny ``family`` model (``qwen3_next`` or ``deepseek_v3``, the tiny-model
    builder's config with ``overrides``) with ``n_predict`` MTP modules (``num_nextn_predict_layers``) into
    ``out_dir``; return ``out_dir``. What vLLM's ``SpeculativeConfig(method="mtp", model=out_dir)`` reads: its
    ``hf_config_override`` makes the draft ``qwen3_next_mtp`` (``Qwen3NextMTP``) or ``deepseek_mtp``
    (``DeepSeekMTPModel``) with ``n_predict`` modules. No weights: for the Scheduler level only."""
    import transformers

    cls_name, kwargs = tiny_config_kwargs(family, num_nextn_predict_layers=n_predict, **overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [_MTP_ARCHITECTURES[family]]
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    # Keys HF's config may not write back (DeepSeek-V3's routing without them cannot load in vLLM).
    for key in ("num_nextn_predict_layers", "topk_method", "scoring_func"):
        if key in kwargs:
            cfg[key] = kwargs[key]
    cfg["torch_dtype"] = "bfloat16"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out_dir
