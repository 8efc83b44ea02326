"""The ``vllm.general_plugins`` entry point: registers ``HybridStoreConnector`` by name."""

from __future__ import annotations

CONNECTOR_NAME = "HybridStoreConnector"


def register() -> None:
    """Register the connector with vLLM's factory; a second call (or another registrant) is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "hybridkv.connector.connector", CONNECTOR_NAME)
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise
