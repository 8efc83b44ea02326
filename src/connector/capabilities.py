"""Whether the engine can use KV it did not compute itself: the gate in front of every load.

A load puts stored KV under tokens the engine then treats as computed; the rest of the prompt is prefilled
on top of it. That needs an engine that can start a prefill from cached KV. vLLM says when it cannot: it turns
prefix caching off, e.g. for MLA models on a CPU without AMX ("MLA is enabled on a non-GPU platform; forcing
chunked prefill and prefix caching to be disabled"), whose reference ``CPU_MLA`` backend prefills only from
token 0. Loading into such an engine does not fail, it gives wrong tokens (vLLM's own ``ExampleConnector``
gives the same wrong tokens), so hybridkv must not load there. Saving is harmless: the KV is the engine's own.

Contract: :func:`load_disabled_reason` is pure (reads the config, logs nothing, imports nothing from vLLM) and
is called with the config vLLM hands the connector, i.e. after vLLM's own config fix-ups (the platform's
``check_and_update_config``), so it sees what the engine really runs with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["BACKENDS_WITHOUT_EXTERNAL_KV", "connector_roles", "load_disabled_reason"]

#: Attention backends (vLLM's ``AttentionBackendEnum`` names) that cannot prefill on top of KV loaded into
#: their cache. ``CPU_MLA``: vLLM's reference CPU MLA backend, whose prefill attends over the new tokens
#: only (vLLM disables prefix caching and chunked prefill for it). Checked on its own as well (for MLA
#: models: vLLM uses it for nothing else), so a config that selects it with prefix caching forced back on
#: still never loads.
BACKENDS_WITHOUT_EXTERNAL_KV: frozenset[str] = frozenset({"CPU_MLA"})


def _backend_name(vllm_config: VllmConfig) -> str | None:
    """The MLA attention backend the config selects explicitly (its enum name), or None: vLLM picks one, or
    the model has no MLA (vLLM then ignores an MLA backend named in the config)."""
    if not getattr(vllm_config.model_config, "use_mla", False):
        return None
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    if backend is None:
        return None
    return str(getattr(backend, "name", backend))


def load_disabled_reason(vllm_config: VllmConfig) -> str | None:
    """Why the engine of ``vllm_config`` cannot use loaded KV (one sentence for operators), or None if it can.

    Loads are off when vLLM has prefix caching disabled (``cache_config.enable_prefix_caching`` false after
    vLLM's config fix-ups) or the selected attention backend is in :data:`BACKENDS_WITHOUT_EXTERNAL_KV`.
    """
    backend = _backend_name(vllm_config)
    if backend in BACKENDS_WITHOUT_EXTERNAL_KV:
        return f"attention backend {backend} cannot prefill on top of KV it did not compute"
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return (
            "vLLM has prefix caching disabled (cache_config.enable_prefix_caching is false after vLLM's "
            "config checks): the engine cannot start a prefill from cached KV"
        )
    return None


def connector_roles(vllm_config: VllmConfig) -> tuple[bool, bool, str | None]:
    """``(can_save, can_load, loads_off)`` of an engine: ``kv_role`` decides (a producer saves, a consumer
    loads, ``kv_both`` does both), and a consumer whose engine cannot use loaded KV does not load
    (``loads_off``: :func:`load_disabled_reason`'s sentence; saves go on -- wrong tokens, not an error,
    are what loading there would give)."""
    tc = vllm_config.kv_transfer_config
    assert tc is not None, "HybridStoreConnector runs only with a kv_transfer_config"
    loads_off = load_disabled_reason(vllm_config) if tc.is_kv_consumer else None
    return bool(tc.is_kv_producer), bool(tc.is_kv_consumer) and loads_off is None, loads_off
