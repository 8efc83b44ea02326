"""docs/configuration.md: its ``kv_connector_extra_config`` table lists exactly the keys the connector knows, with
the code's defaults, and its parameter table names every parameter the store URL parser reads, per scheme."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hybridkv.connector.config import KNOWN_KEYS, ConnectorConfig, default_store_url, parse_size
from hybridkv.store.faulty import FAULTY_PARAMS
from hybridkv.store.url import FAULTY_PREFIX, INTEGRITY_PARAMS, STORE_KINDS
from support.docs import DOCS, names, table_rows

PAGE = DOCS / "configuration.md"


def test_config_table_matches_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = {names(row[0])[0]: row[1] for row in table_rows(PAGE, "key")}
    assert sorted(rows) == sorted(KNOWN_KEYS), (
        "configuration.md kv_connector_extra_config table != KNOWN_KEYS"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = "/models/Qwen3-Next-80B-A3B-Instruct"
    defaults = ConnectorConfig.from_extra_config({}, model=model)
    for key, cell in rows.items():
        shown = names(cell)[0] if names(cell) else cell
        actual = getattr(defaults, key)
        if key == "store":
            assert shown.replace("$XDG_CACHE_HOME", str(tmp_path)) == actual == default_store_url(), cell
        elif key == "namespace":
            assert actual == Path(model).name and "folder name" in cell, cell
        elif key == "audit_log":
            assert actual is None and shown == "none", cell
        elif key == "weights_version":
            assert actual == "" and shown == "none", cell
        elif key == "weights_version_file":
            assert actual is None and shown == "none", cell
        elif key == "put_wave_bytes":
            assert parse_size(key, shown) == actual, cell
        elif key in ("verify_checksums", "divergent_local_hits", "lookup_process", "step_trace"):
            assert json.loads(shown) is actual, cell
        elif key in ("load_mode", "cuda_copy", "worker_cpus"):
            assert shown == actual, cell
        else:
            assert float(shown) == actual, f"{key}: configuration.md says {cell}, code {actual}"


def documented_params() -> dict[str, set[str]]:
    """scheme column (``file://``, ``faulty+``, ``every scheme``) -> the parameters its rows name."""
    found: dict[str, set[str]] = {}
    for row in table_rows(PAGE, "scheme"):
        scheme = names(row[0])[0] if names(row[0]) else row[0]
        found.setdefault(scheme, set()).update(names(row[1]))
    return found


def test_every_store_url_parameter_is_documented() -> None:
    documented = documented_params()
    expected: dict[str, set[str]] = {f"{kind.scheme}://": set(kind.params) for kind in STORE_KINDS.values()}
    expected["memory://"].add("quotas")  # read by the memory store's opener beside its registry row's params
    expected[FAULTY_PREFIX] = set(FAULTY_PARAMS)
    expected["every scheme"] = {"checksum", *INTEGRITY_PARAMS}
    for scheme, params in expected.items():
        missing = params - documented.get(scheme, set())
        assert not missing, f"configuration.md: no row for {scheme} parameters {sorted(missing)}"
        extra = documented.get(scheme, set()) - params
        assert not extra, (
            f"configuration.md: {scheme} rows name parameters the code does not read: {sorted(extra)}"
        )


def test_every_scheme_has_a_url_row() -> None:
    rows = [row[0] for row in table_rows(PAGE, "URL")]
    for scheme in [*(f"{kind.scheme}://" for kind in STORE_KINDS.values()), FAULTY_PREFIX]:
        assert any(re.search(rf"`{re.escape(scheme)}", cell) for cell in rows), (
            f"configuration.md: the Store URLs table has no row for {scheme}"
        )
