"""The installable package: `python -m build` makes an sdist and a wheel; the wheel, installed into a fresh
virtual environment next to the CPU vLLM, runs the engine round trip and the `hybridkv` command from the
install (not from the source tree); the `vllm` extra resolves against vLLM 0.32, 0.33 and 0.34.

The fresh environment sees the test environment's packages (vLLM, torch, ...) through a view of its
site-packages that leaves hybridkv out (no editable finder, no second `hybridkv` distribution), so the
only hybridkv it can import is the wheel's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".pp", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", ".hypothesis", "bench-results",
)  # fmt: skip


def _run(argv: list[str], *, cwd: Path, timeout: int = 600, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert done.returncode == 0, (
        f"{argv[:4]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


def _clean_env() -> dict[str, str]:
    """The environment without anything that points Python at the source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build` on a copy of the source tree (the build must not write into the checkout)."""
    work = tmp_path_factory.mktemp("build")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE, symlinks=True)
    out = work / "dist"
    # --no-isolation: build with this environment's setuptools, no download.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)], cwd=work)
    return out


def test_build_makes_an_sdist_and_a_wheel(dist: Path) -> None:
    (sdist,) = dist.glob("hybridkv-*.tar.gz")
    (wheel,) = dist.glob("hybridkv-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hybridkv/connector/connector.py" in names and "hybridkv/py.typed" in names
    assert not any(n.startswith(("tests/", "src/")) for n in names), "the wheel ships the test or source tree"
    src = Path(__file__).resolve().parents[2] / "src"
    packages = {
        f"hybridkv/{init.parent.relative_to(src)}/__init__.py".replace("/./", "/")
        for init in src.rglob("__init__.py")
    }
    missing = sorted(name for name in packages if name not in names)
    assert not missing, f"packages under src/ the wheel leaves out (pyproject.toml's packages): {missing}"
    # The product first: nothing of the development distribution ships, and the benches an operator runs
    # against their own deployment and the demo are at most a quarter of the wheel's code.
    assert not any(n.startswith("hybridkv_dev/") for n in names), (
        "the wheel ships the development distribution"
    )
    with zipfile.ZipFile(wheel) as archive:
        num_lines = {n: archive.read(n).count(b"\n") for n in names if n.endswith(".py")}
    num_tooling = sum(v for n, v in num_lines.items() if n.startswith(("hybridkv/bench/", "hybridkv/demo/")))
    assert num_tooling <= 0.25 * sum(num_lines.values()), (
        f"benches and demo: {num_tooling} of the wheel's {sum(num_lines.values())} lines of code"
    )
    metadata = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    )
    assert 'Requires-Dist: vllm<0.35,>=0.32; extra == "vllm"' in metadata
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert "hybridkv = hybridkv.cli:main" in entry_points
    assert "hybridkv = hybridkv.connector.plugin:register" in entry_points
    assert sdist.stat().st_size > 0


def _fresh_venv(dist: Path, root: Path) -> Path:
    """A venv with the wheel installed, seeing this environment's other packages through a filtered view."""
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root)
    view = root / "site-view"
    view.mkdir()
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for entry in site_packages.iterdir():
        if "hybridkv" in entry.name.lower():
            continue  # the editable install's finder, .pth and dist-info
        (view / entry.name).symlink_to(entry)
    venv_site = Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=root,
        ).strip()
    )
    # addsitedir also processes the .pth files of the view (the packages that need them).
    (venv_site / "zz-test-deps.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    (wheel,) = dist.glob("hybridkv-*.whl")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        cwd=root,
        env=_clean_env(),
    )
    return venv


_ROUND_TRIP = """
import json, sys
from pathlib import Path
import hybridkv
assert Path(hybridkv.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), hybridkv.__file__
from support.engines import connectors, engine, generate, prompt, reset_local_cache
from hybridkv.demo.tiny_models import build_tiny_model

model = build_tiny_model("qwen3_next", Path(sys.argv[1]))
work = Path(sys.argv[2])
extra = {"store": f"file://{work}/store?capacity=256MiB", "audit_log": str(work / "audit.jsonl"), "lookup_budget_ms": 5000}
tokens = prompt(300)
with engine(model, extra, module_path=False) as llm:  # the connector found through the wheel's entry point
    cold, cached_cold = generate(llm, tokens)
    reset_local_cache(llm)
    warm, cached_warm = generate(llm, tokens)
    sched, _ = connectors(llm)
    connector_file = sys.modules[type(sched).__module__].__file__
print(json.dumps({"hybridkv": hybridkv.__file__, "connector": connector_file, "same": cold == warm,
                  "cached_cold": cached_cold, "cached_warm": cached_warm}))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_installed_wheel_runs_the_engine_round_trip(dist: Path, tmp_path: Path) -> None:
    from support.engines import MODELS_DIR

    venv = _fresh_venv(dist, tmp_path)
    python = str(venv / "bin" / "python")
    run_dir = tmp_path / "run"  # not the source tree: nothing there to import from by accident
    run_dir.mkdir()
    (run_dir / "round_trip.py").write_text(_ROUND_TRIP)
    (run_dir / "support").mkdir()  # test helpers only (the script's folder is first on its sys.path)
    for helper in ("__init__.py", "engines.py"):
        shutil.copy(ROOT / "tests" / "support" / helper, run_dir / "support" / helper)
    out = _run([python, "round_trip.py", str(MODELS_DIR), str(run_dir)], cwd=run_dir, env=_clean_env())
    result = json.loads(out.strip().splitlines()[-1])
    venv_root = str(venv.resolve())
    assert result["hybridkv"].startswith(venv_root) and result["connector"].startswith(venv_root), result
    assert result["same"] and result["cached_cold"] == 0 and result["cached_warm"] > 0, result
    # The console script of the install audits the log the engine wrote.
    report = json.loads(
        _run(
            [str(venv / "bin" / "hybridkv"), "audit", "--json", "audit.jsonl"], cwd=run_dir, env=_clean_env()
        )
    )
    assert report["ok"] and report["num_lifecycles"] > 0


@pytest.mark.slow
@pytest.mark.registry
@pytest.mark.parametrize("vllm_version", ["0.32.0", "0.33.0", "0.34.0"])
def test_vllm_extra_resolves(dist: Path, tmp_path: Path, vllm_version: str) -> None:
    """`pip install --dry-run "hybridkv[vllm]" vllm==X` resolves from the configured package index.

    An index that lacks a release vLLM itself pins (this machine's has no `flashinfer-python==0.7.3`, which
    vLLM 0.34.0 pins) fails pip only after it took vLLM X for the extra: an expected failure naming that
    release. A range of hybridkv's that excludes X fails before, with conflicting dependencies."""
    (wheel,) = dist.glob("hybridkv-*.whl")
    report_path = tmp_path / "report.json"
    argv = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--report", str(report_path), f"{wheel}[vllm]", f"vllm=={vllm_version}",
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    missing = re.search(r"No matching distribution found for (\S+) \(from vllm\)", done.stderr)
    if done.returncode != 0 and missing is not None:
        pytest.xfail(f"the package index lacks {missing[1]}, which vLLM {vllm_version} pins itself")
    assert done.returncode == 0, f"pip failed ({done.returncode}):\n{done.stderr[-4000:]}"
    resolved = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report_path.read_text())["install"]
    }
    assert resolved["vllm"] == vllm_version and resolved["hybridkv"] == "0.1.0", resolved
    assert "torch" in resolved
