"""Validation of kv_connector_extra_config (pure; no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridkv.connector.config import ConnectorConfig, parse_size


def parse(extra: dict[str, object]) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(extra, model="/models/tiny-llama/")


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = parse({})
    assert cfg.store.startswith(f"file://{tmp_path}/hybridkv/store?capacity=")
    assert cfg.namespace == "tiny-llama"
    assert cfg.audit_log is None
    assert cfg.put_wave_bytes == 64 << 20
    assert cfg.lookup_budget_ms == 200.0
    assert cfg.verify_checksums is True
    assert cfg.load_mode == "async" and not cfg.layerwise
    assert cfg.cuda_copy == "auto"


def test_full_config(tmp_path: Path) -> None:
    cfg = parse(
        {
            "store": "memory://x",
            "namespace": "prod-a",
            "audit_log": str(tmp_path / "audit.jsonl"),
            "put_wave_bytes": "16MiB",
            "lookup_budget_ms": 5,
            "verify_checksums": False,
            "load_mode": "layerwise",
            "cuda_copy": "dma",
        }
    )
    assert cfg.store == "memory://x" and cfg.namespace == "prod-a"
    assert cfg.audit_log == str(tmp_path / "audit.jsonl")
    assert cfg.put_wave_bytes == 16 << 20 and cfg.lookup_budget_ms == 5.0 and not cfg.verify_checksums
    assert cfg.load_mode == "layerwise" and cfg.layerwise
    assert cfg.cuda_copy == "dma"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("stor", "memory://x"),
        ("store", "redis://x"),
        ("store", 3),
        ("namespace", "a/b"),
        ("namespace", "-leading-dash"),
        ("namespace", "_private"),
        ("namespace", ""),
        ("namespace", "x" * 65),
        ("audit_log", 7),
        ("audit_log", "/does/not/exist/audit.jsonl"),
        ("put_wave_bytes", 0),
        ("put_wave_bytes", -5),
        ("put_wave_bytes", "lots"),
        ("put_wave_bytes", True),
        ("lookup_budget_ms", 0),
        ("lookup_budget_ms", "fast"),
        ("lookup_budget_ms", float("nan")),
        ("verify_checksums", "yes"),
        ("verify_checksums", 1),
        ("load_mode", "sync"),
        ("load_mode", "Layerwise"),
        ("load_mode", None),
        ("load_mode", 1),
        ("cuda_copy", "cuda"),
        ("cuda_copy", None),
        ("cuda_copy", True),
        ("weights_version", "v1/step 7"),
        ("weights_version", ""),
        ("weights_version", 7),
        ("weights_version", "x" * 65),
    ],
)
def test_bad_key_or_value_names_both(key: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse({key: value})
    msg = str(info.value)
    assert repr(key) in msg or key in msg
    assert repr(value)[:20] in msg


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1KiB", 1024),
        ("2MiB", 2 << 20),
        ("3GiB", 3 << 30),
        ("64MB", 64 * 10**6),
        ("2Gi", 2 << 30),
        (17, 17),
        ("9", 9),
    ],
)
def test_parse_size(text: object, n: int) -> None:
    assert parse_size("k", text) == n


def test_config_sizes_mean_what_store_urls_mean() -> None:
    """One parser: ``64MB`` is 64 * 10**6 bytes in a config key exactly as in a store URL."""
    from hybridkv.store import parse_size as url_parse_size

    for text in ("64MB", "64MiB", "2GB", "1.5GiB", "8 kb", "4096"):
        assert parse_size("put_wave_bytes", text) == url_parse_size(text), text


@pytest.mark.parametrize("text", ["64m", "64M", "1k", "3G", "2t"])
def test_bare_unit_letters_are_rejected_as_ambiguous(text: str) -> None:
    number, letter = text[:-1], text[-1].upper()
    with pytest.raises(ValueError) as info:
        parse({"put_wave_bytes": text})
    msg = str(info.value)
    assert "'put_wave_bytes'" in msg and repr(text) in msg and "ambiguous" in msg
    assert f"{number}{letter}iB" in msg and f"{number}{letter}B" in msg, msg


@pytest.mark.parametrize(
    ("store", "verify", "expected"),
    [
        ("memory://a", True, "memory://a"),
        ("memory://a", False, "memory://a?checksum=none"),
        ("faulty+memory://a?get_fail=0.5", False, "faulty+memory://a?get_fail=0.5&checksum=none"),
        ("memory://a?checksum=crc32", False, "memory://a?checksum=crc32"),
    ],
)
def test_verify_checksums_maps_onto_the_store_url(store: str, verify: bool, expected: str) -> None:
    from hybridkv.connector.stores import store_url

    assert store_url(parse({"store": store, "verify_checksums": verify})) == expected


def test_unopenable_store_fails_with_the_key_named(tmp_path: Path) -> None:
    from hybridkv.connector.stores import open_connector_store

    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['store'\]"):
        open_connector_store(parse({"store": "memory://a?capacity=lots"}))
    s = open_connector_store(parse({"store": "memory://ok", "verify_checksums": False}))
    s.close()


def test_default_store_opens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from hybridkv.connector.stores import open_connector_store

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = open_connector_store(parse({}))
    try:
        assert store.stats().capacity_bytes == 8 << 30
        assert (tmp_path / "hybridkv" / "store").is_dir()
    finally:
        store.close()


def test_default_namespace_is_a_valid_key_segment() -> None:
    # A model folder named "_private" must not yield a namespace the key scheme rejects at engine start.
    from hybridkv.connector.config import default_namespace

    for model in ("/models/_private", "org/.hidden-model", "/"):
        namespace = default_namespace(model)
        assert namespace[0].isalnum(), f"default namespace {namespace!r} of {model!r} starts with a symbol"
        assert ConnectorConfig.from_extra_config({}, model=model).namespace == namespace
