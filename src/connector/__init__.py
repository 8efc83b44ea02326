"""hybridkv.connector: the vLLM adapter (``HybridStoreConnector``).

Use it with prefix caching on and failed loads recomputed::

    vllm serve MODEL --enable-prefix-caching --kv-transfer-config '{
        "kv_connector": "HybridStoreConnector", "kv_connector_module_path": "hybridkv.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "file:///dev/shm/hybridkv?capacity=8GiB",
                                      "namespace": "prod-a", "audit_log": "audit.jsonl"}}'

(``kv_connector_module_path`` may be left out: the ``hybridkv`` vLLM plugin registers the name.) The keys
of ``kv_connector_extra_config`` are documented in :mod:`hybridkv.connector.config`.

Modules: ``connector`` (the facade vLLM calls), ``scheduler`` / ``worker`` (the two halves), ``metadata``
(messages between them), ``geometry`` (vLLM config -> lifecycle key scheme), ``stats`` (counters,
Prometheus), ``stores`` (opening the configured store), ``datapath`` (block gather/scatter), ``plugin``
(the vLLM entry point). vLLM is imported only when ``HybridStoreConnector`` is touched, so ``config`` stays
importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "HybridStoreConnector":
        from hybridkv.connector.connector import HybridStoreConnector

        return HybridStoreConnector
    raise AttributeError(f"module 'hybridkv.connector' has no attribute {name!r}")
