"""The committed diagrams are generated from the table and must not be stale."""

from __future__ import annotations

import re
from pathlib import Path

from hybridkv.audit.diagram import render_dot, render_mermaid
from hybridkv.cli import main
from hybridkv.lifecycle.table import TRANSITIONS, State

DIAGRAMS = Path(__file__).resolve().parents[2] / "docs" / "diagrams"


def test_committed_diagrams_are_current() -> None:
    for name, text in (("lifecycle.mmd", render_mermaid()), ("lifecycle.dot", render_dot())):
        committed = (DIAGRAMS / name).read_text(encoding="utf-8")
        assert committed == text, f"docs/diagrams/{name} is stale: run `hybridkv diagram`"


def test_mermaid_has_every_state_and_edge() -> None:
    text = render_mermaid()
    edges = re.findall(r"^\s+(\w+) --> (\w+): (\w+)", text, flags=re.MULTILINE)
    assert len(edges) == sum(len(spec.sources) for spec in TRANSITIONS)
    nodes = {a for a, _, _ in edges} | {b for _, b, _ in edges}
    assert nodes == {s.name for s in State}


def test_cli_check_detects_stale(tmp_path: Path) -> None:
    assert main(["diagram", "--out", str(tmp_path)]) == 0
    assert main(["diagram", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "lifecycle.mmd").write_text("stale\n")
    assert main(["diagram", "--out", str(tmp_path), "--check"]) == 1
