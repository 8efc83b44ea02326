"""``put_wave_bytes`` has a ceiling (``MAX_PUT_WAVE_BYTES``, 16 GiB): a value int64 holds but no host pins
(``2**62``) stops the engine at start on both roles with a message naming the key and the value, instead of
failing later at the worker's pinned allocation."""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.connector.config import MAX_PUT_WAVE_BYTES, ConnectorConfig
from hybridkv_dev.devkit.cluster import kv_cache_config


@pytest.mark.parametrize("value", [MAX_PUT_WAVE_BYTES + 1, 2**62, (1 << 63) - 1, "17GiB", "1TiB", "64GB"])
def test_a_wave_beyond_the_ceiling_is_refused_naming_key_and_value(value: object) -> None:
    with pytest.raises(ValueError) as info:
        ConnectorConfig.from_extra_config({"store": "memory://x", "put_wave_bytes": value}, model="m")
    message = str(info.value)
    assert message.startswith("kv_connector_extra_config['put_wave_bytes']: must be at most "), message
    assert repr(value) in message and "16GiB" in message, message


@pytest.mark.parametrize("value", [MAX_PUT_WAVE_BYTES, "16GiB", "1GiB", 1])
def test_a_wave_up_to_the_ceiling_is_accepted(value: object) -> None:
    cfg = ConnectorConfig.from_extra_config({"store": "memory://x", "put_wave_bytes": value}, model="m")
    assert 0 < cfg.put_wave_bytes <= MAX_PUT_WAVE_BYTES


@pytest.mark.vllm
def test_an_absurd_wave_fails_connector_init_on_both_roles(vllm_objs: dict[str, Any]) -> None:
    from hybridkv.connector import HybridStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = vllm_objs["vc"]
    extra = vc.kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    extra["put_wave_bytes"] = 2**62
    try:
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=r"'put_wave_bytes'.*4611686018427387904"):
                HybridStoreConnector(vc, role, kv_cache_config())
    finally:
        extra.clear()
        extra.update(saved)
