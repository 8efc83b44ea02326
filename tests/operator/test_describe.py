"""`hybridkv describe`: geometry from a real engine, store health and usage, entries per namespace and group;
and it never changes the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hybridkv.cli import main
from hybridkv.connector.identity import MANIFEST_NAME
from hybridkv.store import open_store


def _snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``directory``: (size, mtime_ns, content). Equal snapshots: nothing was changed."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns, path.read_bytes())
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _describe_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main(["describe", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _filled_store(directory: Path) -> str:
    url = f"file://{directory}?capacity=64MiB"
    keys = [
        f"hkv1/{namespace}/0123456789ab/g{group}/tp{rank}/dcp0/{index:032x}"
        for namespace in ("prod-a", "prod-b")
        for group in (0, 1)
        for rank in (0, 1)
        for index in range(3 + group)
    ]
    with open_store(url) as store:
        assert all(s.is_ok for s in store.put([*keys, "not/a/hybridkv/key"], [b"v" * 100] * (len(keys) + 1)))
    return url


def test_store_url_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _filled_store(tmp_path / "store")
    before = _snapshot(tmp_path / "store")
    code, report = _describe_json(["--store", url], capsys)
    assert code == 0
    assert _snapshot(tmp_path / "store") == before, "describe changed the store"
    health = report["health"]
    assert health["reachable"] and health["breaker_state"] == "closed" and health["exists_probes"] == 5
    assert 0 < health["exists_p50_ms"] <= health["exists_max_ms"]
    assert report["usage"]["num_keys"] == 29 and report["usage"]["num_other_keys"] == 1
    assert report["usage"]["capacity_bytes"] == 64 << 20
    rows = {(r["namespace"], r["group"]): (r["entries"], r["ranks"]) for r in report["entries"]}
    assert rows == {
        ("prod-a", 0): (6, ["tp0/dcp0", "tp1/dcp0"]),
        ("prod-a", 1): (8, ["tp0/dcp0", "tp1/dcp0"]),
        ("prod-b", 0): (6, ["tp0/dcp0", "tp1/dcp0"]),
        ("prod-b", 1): (8, ["tp0/dcp0", "tp1/dcp0"]),
    }
    assert main(["describe", "--store", url]) == 0
    text = capsys.readouterr().out
    assert "namespace prod-a: 14 entries" in text and "lookup breaker closed" in text


def test_config_json_names_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _filled_store(tmp_path / "store")
    config = json.dumps({"kv_connector_extra_config": {"store": url, "namespace": "prod-a"}})
    code, report = _describe_json(["--config", config], capsys)
    assert code == 0 and report["store"] == url and report["namespace"] == "prod-a"
    (tmp_path / "extra.json").write_text(json.dumps({"store": url, "lookup_budget_ms": 250}))
    code, report = _describe_json(["--config", f"@{tmp_path / 'extra.json'}"], capsys)
    assert code == 0 and report["health"]["exists_deadline_ms"] == 250


@pytest.mark.parametrize(
    ("params", "error"),
    [("exists_fail=1", "exists answered transfer_failed"), ("delay_ms=400", "did not answer within 100 ms")],
)
def test_unhealthy_store_opens_the_breaker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], params: str, error: str
) -> None:
    url = _filled_store(tmp_path / "store")
    faulty = f"faulty+{url}&{params}"
    code, report = _describe_json(["--store", faulty, "--config", '{"lookup_budget_ms": 100}'], capsys)
    assert code == 1
    assert not report["health"]["reachable"] and report["health"]["breaker_state"] == "open"
    assert error in report["health"]["error"]


def test_absent_file_store_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _describe_json(["--store", f"file://{tmp_path / 'nothing'}"], capsys)
    assert code == 1 and "no file store" in report["health"]["error"]
    assert not (tmp_path / "nothing").exists()


def test_bad_config_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "--config", '{"store": "memory://", "lookup_budget": 5}']) == 2
    assert "lookup_budget" in capsys.readouterr().err
    assert main(["describe", "--config", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
def test_model_geometry_matches_the_serving_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve a hybrid model (attention + Mamba) into a file store, then describe it: the fingerprint and the
    per-group geometry are the serving connector's, the entries are the keys it wrote, bytes per group are
    entries x the group's block bytes."""
    from hybridkv.demo.tiny_models import build_tiny_model
    from support.engines import MODELS_DIR, connectors, engine, flush_saves, generate, prompt

    model = build_tiny_model("qwen3_next", MODELS_DIR)
    extra = {
        "store": f"file://{tmp_path}/store?capacity=256MiB",
        "namespace": "demo",
        "lookup_budget_ms": 5000,
    }
    with engine(model, extra) as llm:
        generate(llm, prompt(256, seed=3))
        flush_saves(llm)
        sched, _worker = connectors(llm)
        served = sched.scheduler_side.geo
        fingerprint = served.scheme.fingerprint
    before = _snapshot(tmp_path / "store")
    # A separate process, as an operator runs it: stdout must be the JSON alone (vLLM logs to stderr).
    argv = ["describe", "--config", json.dumps(extra), "--model", str(model), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert _snapshot(tmp_path / "store") == before, "describe changed the store"
    geometry = report["geometry"]
    assert geometry["fingerprint"] == fingerprint and geometry["namespace"] == "demo"
    assert geometry["hash_unit"] == served.geometry.hash_unit
    assert geometry["hit_alignment"] == served.geometry.hit_alignment
    assert [(g["kind"], g["span"]) for g in geometry["groups"]] == [
        (info.kind.value, info.span) for info in served.groups
    ]
    assert {g["kind"] for g in geometry["groups"]} == {"full", "mamba"}
    with open_store(extra["store"]) as store:
        # Block entries; the deployment's manifest (one small value) is not a block.
        keys = [k for k in store.iter_keys(served.scheme.geometry_prefix) if not k.endswith(MANIFEST_NAME)]
    rows = [r for r in report["entries"] if r["fingerprint"] == fingerprint]
    assert sum(r["entries"] for r in rows) == len(keys) > 0
    entry_bytes = {g["group"]: g["entry_bytes"] for g in geometry["groups"]}
    for row in rows:
        assert row["payload_bytes"] == row["entries"] * entry_bytes[row["group"]] > 0
    # The file store's objects are frames: payload plus a small header, so the bytes agree within it.
    num_bytes = sum(os.path.getsize(p) for p in (tmp_path / "store" / "objects").rglob("*") if p.is_file())
    payload = sum(r["payload_bytes"] for r in rows)
    manifest_bytes = 4096 + 256  # the manifest's value and its frame
    assert payload <= num_bytes <= payload + 256 * len(keys) + manifest_bytes
