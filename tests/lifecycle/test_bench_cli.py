"""``hybridkv bench lifecycle`` runs and writes its JSON report (timings are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv.cli import main


def test_bench_lifecycle_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "lifecycle.json"
    assert main(["bench", "lifecycle", "--iterations", "50", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["sink"] for row in report["rows"]} == {"none", "memory", "json"}
    assert all(row["us_per_transition"] > 0 for row in report["rows"])
