"""README.md: the ``kv_connector_extra_config`` table lists exactly the known keys with the code's defaults; the
README links every page under docs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.connector.config import KNOWN_KEYS, ConnectorConfig, default_store_url, parse_size
from support.docs import DOCS, README, ROOT, iter_links, names, table_rows


def test_readme_config_table_matches_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = {names(row[0])[0]: row[1] for row in table_rows(README, "key")}
    assert sorted(rows) == sorted(KNOWN_KEYS), "README kv_connector_extra_config table != KNOWN_KEYS"
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
        elif key in ("verify_checksums", "divergent_local_hits", "lookup_process"):
            assert json.loads(shown) is actual, cell
        elif key in ("load_mode", "cuda_copy"):
            assert shown == actual, cell
        else:
            assert float(shown) == actual, f"{key}: README says {cell}, code {actual}"


def test_readme_links_every_doc() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for path, target in iter_links()
        if path == README
    }
    for doc in sorted(DOCS.glob("*.md")):
        assert doc.resolve() in linked, f"README.md does not link {doc.relative_to(ROOT)}"


def test_doc_files_exist() -> None:
    for name in ("lifecycle.md", "keys.md", "failure-semantics.md", "metrics.md", "operations.md"):
        assert (DOCS / name).is_file(), name
