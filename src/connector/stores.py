"""Opening the configured store (adapter onto ``hybridkv.store.open_store``)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from hybridkv.connector.config import ConnectorConfig
from hybridkv.store.base import Store


def store_url(cfg: ConnectorConfig) -> str:
    """``cfg.store``, with ``checksum=none`` added when ``verify_checksums`` is false and the URL names none.

    The store frames every value; ``checksum=none`` writes frames without a payload checksum (header,
    key digest and length are still checked). Frames that carry a checksum are always verified, so
    turning verification off never makes a damaged checksummed entry readable.
    """
    url: str = cfg.store
    if cfg.verify_checksums or "checksum" in parse_qs(urlsplit(url).query):
        return url
    return url + ("&" if "?" in url else "?") + "checksum=none"


def open_connector_store(cfg: ConnectorConfig) -> Store:
    """Open the configured store; a bad URL raises ``ValueError`` naming the ``store`` key (engine start fails)."""
    from hybridkv.store import open_store  # the store subsystem's factory

    url = store_url(cfg)
    try:
        return open_store(url)
    except Exception as exc:  # StoreError and friends: a configuration error at engine start
        raise ValueError(f"kv_connector_extra_config['store']: cannot open {cfg.store!r}: {exc}") from exc
