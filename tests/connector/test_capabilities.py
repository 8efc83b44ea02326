"""Never load into an engine that cannot use loaded KV (``hybridkv.connector.capabilities``).

vLLM's real ``Scheduler`` with the connector's scheduler half over a store that holds every entry of a prompt:
with prefix caching on, the prompt loads; where vLLM has prefix caching off, the connector answers 0 without
asking the store, says why at start (``LOADS_DISABLED``), and still saves. And the decision over real vLLM
configs: an MLA model with the ``CPU_MLA`` backend (vLLM turns prefix caching off for it) never loads.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hybridkv.connector.capabilities import load_disabled_reason
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.ops import inprocess
from hybridkv.store import open_store
from hybridkv.store.memory import MemoryBackend
from hybridkv_dev.devkit.cluster import two_group_cache_config
from structlog.testing import capture_logs

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

BLOCK = 16
PROMPT = list(range(40, 40 + 5 * BLOCK + 3))  # 5 full blocks and a tail


@pytest.fixture
def exists_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Keys per ``exists`` call any memory store in this process answers."""
    calls: list[int] = []
    exists = MemoryBackend.exists

    def counted(self: MemoryBackend, keys: Any) -> Any:
        calls.append(len(keys))
        return exists(self, keys)

    monkeypatch.setattr(MemoryBackend, "exists", counted)
    yield calls


def _scheduler(*, prefix_caching: bool, store_url: str) -> Any:
    """vLLM's ``Scheduler`` over a tiny Llama (one full-attention group, block 16) with the connector."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = build_tiny_model("llama", DEFAULT_MODELS_DIR)
    vc = vllm_harness.connector_vllm_config(
        model, {"store": store_url, "lookup_budget_ms": 5000}, block_size=BLOCK, num_blocks=64
    )
    vc.cache_config.enable_prefix_caching = prefix_caching
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kvc = two_group_cache_config(64, 2048, ("model.layers.0.self_attn.attn", spec))
    vllm_harness.resolve_cache_block_sizes(kvc, vc)
    return Scheduler(vc, kvc, StructuredOutputManager(vc), block_size=BLOCK, hash_block_size=BLOCK)


def _fill_prompt(side: Any, store_url: str, request: Any) -> None:
    """Every block of ``request`` present in the store under ``side``'s keys (rank 0, group 0)."""
    keys = [side.scheme.key(0, 0, h) for h in request.block_hashes]
    with open_store(store_url) as store:
        assert all(s.is_ok for s in store.put(keys, [b"x"] * len(keys)))


def test_prefix_caching_off_never_loads_and_never_asks_the_store(exists_calls: list[int]) -> None:
    store_url = f"memory://capabilities-{uuid.uuid4().hex[:8]}"

    # Control: the same store, prefix caching on -> the prompt's 80 stored tokens load.
    on = _scheduler(prefix_caching=True, store_url=store_url)
    request = vllm_harness.block_hashed_request("on", PROMPT, BLOCK)
    _fill_prompt(on.connector.scheduler_side, store_url, request)
    on.add_request(request)
    (job,) = on.schedule().kv_connector_metadata.loads
    assert job.boundary == 5 * BLOCK and exists_calls, "control: the stored prompt must load"
    on.connector.shutdown()

    exists_calls.clear()
    with capture_logs() as logs:
        off = _scheduler(prefix_caching=False, store_url=store_url)
    side = off.connector.scheduler_side
    assert side.can_load is False and side.can_save is True
    (warning,) = [line for line in logs if line["event"] == ConnectorLogEvent.LOADS_DISABLED]
    assert warning["log_level"] == "warning" and "prefix caching" in warning["reason"]
    assert warning["saves"] is True

    off.add_request(vllm_harness.block_hashed_request("off", PROMPT, BLOCK))
    out = off.schedule()
    assert out.kv_connector_metadata.loads == []
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and out.num_scheduled_tokens["off"] == len(PROMPT), (
        "the whole prompt must be computed"
    )
    assert side.lookup(off.requests["off"], 0) == (0, False)
    assert exists_calls == [], "a connector that cannot load must not ask the store"
    assert side.stats.totals.get("lookups", 0) == 0
    off.connector.shutdown()


def _mla_vllm_config(attention_backend: str | None) -> Any:
    """A CPU ``VllmConfig`` over a tiny DeepSeek-V3 (MLA) with the connector, prefix caching asked for, after
    vLLM's own config fix-ups (the CPU platform's ``check_and_update_config``)."""
    from vllm.config import AttentionConfig, CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    model = build_tiny_model("deepseek_v3", DEFAULT_MODELS_DIR)
    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True, seed=0),
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(enable_prefix_caching=True),
        attention_config=AttentionConfig(backend=attention_backend),
        kv_transfer_config=inprocess.connector_transfer_config({"store": "memory://unused"}),
    )


def test_cpu_mla_backend_turns_loads_off() -> None:
    """``CPU_MLA`` (vLLM's reference CPU MLA backend, prefills only from token 0): vLLM itself turns prefix
    caching off, and the decision says why; vLLM's default MLA backend on an AMX CPU keeps both on."""
    from vllm.platforms import current_platform

    vc = _mla_vllm_config("CPU_MLA")
    reason = load_disabled_reason(vc)
    assert vc.model_config.use_mla and reason is not None and "CPU_MLA" in reason
    if not current_platform.is_cpu():
        # vLLM 0.33 ships a CUDA build only: its CPU platform's fix-ups do not run here, prefix caching stays
        # asked for, and the connector's own check above is what turns loads off.
        assert vc.cache_config.enable_prefix_caching is True
        return
    assert vc.cache_config.enable_prefix_caching is False  # vLLM-CPU's own fix-up

    if torch.cpu._is_amx_tile_supported():
        default = _mla_vllm_config(None)
        assert default.cache_config.enable_prefix_caching is True  # vLLM picks AMX_MLA here
        assert load_disabled_reason(default) is None
    else:  # vLLM's own fix-ups: the reference backend, prefix caching off
        assert "prefix caching" in (load_disabled_reason(_mla_vllm_config(None)) or "")


def _config(*, prefix_caching: bool, use_mla: bool, backend: str | None) -> Any:
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching),
        model_config=types.SimpleNamespace(use_mla=use_mla),
        attention_config=types.SimpleNamespace(backend=backend),
    )


@pytest.mark.parametrize(
    ("prefix_caching", "use_mla", "backend", "off"),
    [
        (True, False, None, None),
        (True, True, "AMX_MLA", None),
        (False, False, None, "prefix caching"),
        (False, True, "AMX_MLA", "prefix caching"),
        # prefix caching forced back on: the backend alone keeps loads off
        (True, True, "CPU_MLA", "CPU_MLA"),
        # vLLM uses an MLA backend only for MLA models: named for another model, it changes nothing
        (True, False, "CPU_MLA", None),
    ],
)
def test_load_disabled_reason(
    prefix_caching: bool, use_mla: bool, backend: str | None, off: str | None
) -> None:
    reason = load_disabled_reason(_config(prefix_caching=prefix_caching, use_mla=use_mla, backend=backend))
    if off is None:
        assert reason is None
    else:
        assert reason is not None and off in reason
