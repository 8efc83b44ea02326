"""The committed diagrams are generated from the table and must not be stale."""

from __future__ import annotations

import re
from pathlib import Path

from hybridkv.audit.diagram import DIAGRAMS, render_engine_mermaid, render_mermaid
from hybridkv.cli import main
from hybridkv.lifecycle.table import ENGINE_TRANSITIONS, TRANSITIONS, EngineState, State

DIAGRAMS_DIR = Path(__file__).resolve().parents[2] / "docs" / "diagrams"


def test_committed_diagrams_are_current() -> None:
    assert {"lifecycle.mmd", "lifecycle.dot", "engine.mmd", "engine.dot"} <= set(DIAGRAMS)
    for name, render in DIAGRAMS.items():
        committed = (DIAGRAMS_DIR / name).read_text(encoding="utf-8")
        assert committed == render(), f"docs/diagrams/{name} is stale: run `hybridkv diagram`"


def test_mermaid_has_every_state_and_edge() -> None:
    text = render_mermaid()
    edges = re.findall(r"^\s+(\w+) --> (\w+): (\w+)", text, flags=re.MULTILINE)
    assert len(edges) == sum(len(spec.sources) for spec in TRANSITIONS)
    nodes = {a for a, _, _ in edges} | {b for _, b, _ in edges}
    assert nodes == {s.name for s in State}


def test_engine_mermaid_has_every_state_and_edge() -> None:
    text = render_engine_mermaid()
    edges = re.findall(r"^\s+(\w+) --> (\w+): (\w+)", text, flags=re.MULTILINE)
    assert len(edges) == sum(len(spec.sources) for spec in ENGINE_TRANSITIONS)
    nodes = {a for a, _, _ in edges} | {b for _, b, _ in edges}
    assert nodes == {s.name for s in EngineState}


def test_cli_check_detects_stale(tmp_path: Path) -> None:
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    assert main(["diagram", "--out", str(tmp_path), "--check"]) == 0
    for name in ("lifecycle.mmd", "engine.mmd"):
        good = (tmp_path / name).read_text()
        (tmp_path / name).write_text("stale\n")
        assert main(["diagram", "--out", str(tmp_path), "--check"]) == 1, name
        (tmp_path / name).write_text(good)
