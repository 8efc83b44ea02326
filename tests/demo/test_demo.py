"""``hybridkv demo``: the seed scenario on a real vLLM engine (slow), plus its fast, engine-free parts.

The slow tests run the real command in a subprocess (real vLLM, real files, a tiny random-weight model)
and check the JSON summary against what each phase must show; a second run with a fault-free "chaos"
store must fail the chaos phase and exit 1, so the checks are not rubber stamps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybridkv.cli import main
from hybridkv.demo import (
    Check,
    DemoOptions,
    DemoReport,
    PhaseResult,
    RequestResult,
    chaos_url,
    make_prompt,
    render,
    shared_prefix_length,
)
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR

MODELS_DIR = DEFAULT_MODELS_DIR
# Small sizes: 4 full 128-token blocks plus a tail; keeps one run around 25 s on 2 cores.
SMALL = ["--prompt-tokens", "600", "--max-tokens", "6"]


class _DemoRun:
    """``hybridkv demo --json`` in a fresh interpreter, started at once; ``result()`` waits for it."""

    def __init__(self, workdir: Path, extra: tuple[str, ...]) -> None:
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the command must set it itself
        cmd = [
            sys.executable,
            "-m",
            "hybridkv.cli",
            "demo",
            "--json",
            "--workdir",
            str(workdir / "work"),
            "--models-dir",
            str(MODELS_DIR),
            *SMALL,
            *extra,
        ]
        self.workdir = workdir
        self.started = time.monotonic()
        self._stdout = (workdir / "stdout.json").open("w+")
        self._stderr = (workdir / "stderr.txt").open("w+")
        self.proc = subprocess.Popen(cmd, stdout=self._stdout, stderr=self._stderr, text=True, env=env)

    def result(self) -> tuple[int, dict[str, Any], str, float]:
        """(exit code, summary, stderr, seconds)."""
        try:
            returncode = self.proc.wait(400)
        finally:
            self.kill()
        seconds = time.monotonic() - self.started
        stdout = (self.workdir / "stdout.json").read_text()
        stderr = (self.workdir / "stderr.txt").read_text()
        try:
            summary = json.loads(stdout)
        except ValueError:
            pytest.fail(f"stdout is not JSON (rc {returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}")
        return returncode, summary, stderr, seconds

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stdout.close()
        self._stderr.close()


#: The slow tests' demo runs (test name -> extra arguments). The runs of the selected tests start together
#: when the first of them asks, and run side by side (each is mostly one interpreter's start-up and waits).
DEMO_RUNS: dict[str, tuple[str, ...]] = {
    "test_demo_default_family_passes_every_phase": (),
    "test_demo_reports_failure_when_the_chaos_store_injects_nothing": (
        "--store",
        "memory://demo-test",
        "--chaos",
        "seed=1",
        "--chaos-rounds",
        "1",
    ),
}


@pytest.fixture(scope="module")
def demo_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, _DemoRun]]:
    selected = {item.name for item in request.session.items if item.name in DEMO_RUNS}
    runs = {name: _DemoRun(tmp_path_factory.mktemp("demo"), DEMO_RUNS[name]) for name in sorted(selected)}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.kill()


def _phases(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in summary["phases"]}


@pytest.mark.slow
def test_demo_default_family_passes_every_phase(demo_runs: dict[str, _DemoRun]) -> None:
    run = demo_runs["test_demo_default_family_passes_every_phase"]
    rc, summary, stderr, seconds = run.result()
    assert rc == 0, (summary.get("error"), stderr[-4000:])
    assert summary["ok"] and summary["audit_ok"] and summary["error"] is None
    assert summary["model_family"] == "qwen3_next"
    phases = _phases(summary)
    assert list(phases) == ["cold", "shared", "external", "restart", "chaos"]
    assert all(p["ok"] for p in phases.values())

    (cold,) = phases["cold"]["requests"]
    assert cold["cached_tokens"] == 0 and cold["saved_bytes"] > 0 and cold["tokens_match"] is None
    reference = cold["output_tokens"]
    assert len(reference) == 6

    (shared,) = phases["shared"]["requests"]
    assert shared["local_hit_tokens"] == 512  # A's prefix up to its last block boundary (4 x 128)
    assert shared["external_hit_tokens"] == 0

    for name in ("external", "restart"):
        (again,) = phases[name]["requests"]
        assert again["external_hit_tokens"] == 512, (name, again)
        assert again["local_hit_tokens"] == 0 and again["cached_tokens"] == 512
        assert again["loaded_bytes"] > 0 and again["truncations"] == 0 and again["failed_keys"] == 0
        assert again["tokens_match"] is True and again["output_tokens"] == reference

    chaos = phases["chaos"]["requests"]
    assert len(chaos) == 2
    assert all(r["tokens_match"] is True and r["output_tokens"] == reference for r in chaos)
    assert sum(r["truncations"] + r["failed_keys"] for r in chaos) > 0
    assert summary["chaos_store"].startswith("faulty+file://")

    audit = summary["audit"]
    assert audit["ok"] and audit["violations"] == []
    assert audit["num_truncations"] == sum(r["truncations"] for r in chaos)
    assert audit["num_lifecycles"] > 0 and audit["num_terminated"] == audit["num_lifecycles"]
    assert Path(summary["audit_log"]).is_file()
    assert (run.workdir / "work" / "demo-report.json").is_file()
    assert "engine ready in" in stderr  # progress on stderr, JSON alone on stdout
    # Wall time is not asserted (the 2 cores are shared); ~25 s alone, ~40 s of CPU.
    print(f"demo run: {seconds:.0f}s wall, timings {summary['timings']}")


@pytest.mark.slow
def test_demo_reports_failure_when_the_chaos_store_injects_nothing(demo_runs: dict[str, _DemoRun]) -> None:
    # A fault-free "chaos" store cannot show truncations: the demo must say so and exit 1, while the
    # other phases (here on the in-process memory store) still pass.
    rc, summary, stderr, _ = demo_runs[
        "test_demo_reports_failure_when_the_chaos_store_injects_nothing"
    ].result()
    assert rc == 1, stderr[-3000:]
    assert not summary["ok"]
    phases = _phases(summary)
    assert all(phases[n]["ok"] for n in ("cold", "shared", "external", "restart")), summary["phases"]
    chaos = phases["chaos"]
    assert not chaos["ok"]
    failed = [c for c in chaos["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == ["faults seen"]
    (r,) = chaos["requests"]
    assert r["external_hit_tokens"] == 512 and r["tokens_match"] is True  # no faults: a clean hit
    assert summary["audit_ok"]


# -- fast: no engine -------------------------------------------------------------------------------


def test_bad_flags_exit_2_without_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--prompt-tokens", "1", "--workdir", str(tmp_path / "w")]) == 2
    assert "prompt tokens 1" in capsys.readouterr().err
    assert main(["demo", "--store", "faulty+memory://x", "--workdir", str(tmp_path / "w")]) == 2
    assert main(["demo", "--chaos-rounds", "0", "--workdir", str(tmp_path / "w")]) == 2
    assert main(["demo", "--model-family", "bamba", "--workdir", str(tmp_path / "w")]) == 2
    assert "model family 'bamba'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_help_does_not_import_vllm() -> None:
    code = "import sys\nfrom hybridkv.cli import main\ntry:\n    main(['demo', '--help'])\nexcept SystemExit:\n    pass\nprint('vllm' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.strip().endswith("False"), proc.stdout
    assert "--model-family" in proc.stdout and "--json" in proc.stdout


def test_prompt_helpers() -> None:
    assert make_prompt(50, 3) == make_prompt(50, 3) != make_prompt(50, 4)
    assert all(3 <= t < 500 for t in make_prompt(1000, 1))
    assert shared_prefix_length(1200, 128) == 1152
    assert shared_prefix_length(1152, 128) == 1024  # at least one token left to compute
    assert shared_prefix_length(100, 128) == 0
    assert chaos_url("file:///s?capacity=1GiB", "get_fail=1") == "faulty+file:///s?capacity=1GiB&get_fail=1"
    assert chaos_url("memory://x", "?seed=3") == "faulty+memory://x?seed=3"
    with pytest.raises(ValueError, match="max tokens"):
        DemoOptions(max_tokens=0).validate()
    with pytest.raises(ValueError, match="model family"):
        DemoOptions(model_family="jamba").validate()


def _request(label: str, match: bool | None) -> RequestResult:
    return RequestResult(label, 600, 512, 0, 512, 1 << 20, 0, 0, 0, match, [1, 2], 0.1)


def test_report_verdict_and_rendering() -> None:
    good = PhaseResult("external", "local prefix cache dropped", "memory://x", [_request("A again", True)])
    good.checks.append(Check("external hits", True, "external 512 tokens"))
    bad = PhaseResult("chaos", "chaos store", "faulty+memory://x", [_request("A chaos #1", False)])
    bad.checks.append(Check("tokens identical to the cold run", False, "0/1 identical"))
    report = DemoReport("qwen3_next", None, "/w", "memory://x", "faulty+memory://x", "demo-1", "/w/a.jsonl")
    report.phases = [good]
    report.audit = {"ok": True, "violations": [], "num_records": 3}
    assert report.ok
    report.audit = {"ok": False, "violations": [{"kind": "illegal", "line": 2}], "num_records": 3}
    assert not report.ok  # an unclean audit fails the demo
    report.audit = {"ok": True, "violations": [], "num_records": 3}
    report.phases.append(bad)
    assert not report.ok
    text = render(report)
    assert "[FAILED]" in text and "DIFFERENT" in text and "result: FAIL" in text
    assert "1.0 MiB" in text and "[ok]" in text
    as_dict = report.to_dict()
    assert as_dict["ok"] is False and [p["ok"] for p in as_dict["phases"]] == [True, False]
    json.dumps(as_dict)
    empty = PhaseResult("cold", "cold", "memory://x")
    assert not empty.ok  # a phase without checks never passes


def test_rejected_options_leave_the_environment_alone(tmp_path: Path) -> None:
    # The demo sets vLLM's environment for its in-process engine; a run refused for bad input must not.
    import os

    before = dict(os.environ)
    assert main(["demo", "--prompt-tokens", "1", "--workdir", str(tmp_path / "w")]) == 2
    assert dict(os.environ) == before
