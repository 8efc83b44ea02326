"""The code stays lint-clean and type-clean (``ruff``, ``mypy --strict`` on the package as installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ruff_finds_nothing() -> None:
    result = subprocess.run(
        [str(BIN / "ruff"), "check", "src", "dev", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_on_the_package(tmp_path: Path) -> None:
    # mypy must see the package under its real name (``hybridkv``), not as ``src``: a link does that
    # (what ``make typecheck`` does, here in a temporary folder). The development distribution beside it.
    (tmp_path / "hybridkv").symlink_to(ROOT / "src")
    env = {**os.environ, "MYPYPATH": f"{tmp_path}{os.pathsep}{ROOT / 'dev'}"}
    command = [str(BIN / "mypy"), "--strict", "--cache-dir", str(ROOT / ".mypy_cache")]
    result = subprocess.run(
        [*command, "-p", "hybridkv", "-p", "hybridkv_dev"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
