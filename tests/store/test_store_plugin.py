"""Stores as plug-ins (``hybridkv.store.plugins``): an out-of-tree store package, installed with pip, is
served like a built-in store.

The package is ``tests/support/store_plugin`` (``hybridkv-dirstore``: one file per key, ``dirstore:///DIR``);
it is installed into a scratch folder with ``pip install --target`` from a copy of its source and put on the
import path, which is all an installed distribution is to ``importlib.metadata``. What must hold: the public
conformance machine passes on it (and on its ``faulty+`` view), the URL is checked at engine start like a
built-in's (a bad parameter named, a near-miss suggested), operator commands refuse a path that holds none of
its stores, ``hybridkv describe`` reports it, a real engine saves to it and hits it with identical tokens,
and a broken plug-in is named without breaking any other scheme.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridkv.connector.config import ConnectorConfig
from hybridkv.store import StoreError, open_store
from hybridkv.store.plugins import plugin_kinds
from hybridkv.store.url import check_store_url, known_schemes, store_kind
from hybridkv.testing.store_fuzz import make_store_machine
from hypothesis.stateful import run_state_machine_as_test

_PLUGIN_SOURCE = Path(__file__).resolve().parents[1] / "support" / "store_plugin"
_TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plug-in installed by pip (from a copy of its source: the build writes next to it) into a folder."""
    root = tmp_path_factory.mktemp("store-plugin")
    source = root / "source"
    shutil.copytree(
        _PLUGIN_SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
        timeout=300,
    )  # fmt: skip
    assert (target / "hybridkv_dirstore").is_dir(), sorted(path.name for path in target.iterdir())
    return target


def _forget_plugins() -> None:
    plugin_kinds.cache_clear()
    for name in [name for name in sys.modules if name.startswith(("hybridkv_dirstore", "broken_store"))]:
        del sys.modules[name]


@pytest.fixture
def with_plugin(installed_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The installed plug-in importable in this process (as after ``pip install``), forgotten afterwards."""
    _forget_plugins()
    monkeypatch.syspath_prepend(str(installed_plugin))
    yield installed_plugin
    monkeypatch.undo()
    _forget_plugins()


def test_without_the_plugin_its_scheme_is_unknown() -> None:
    _forget_plugins()
    with pytest.raises(StoreError, match="unknown scheme 'dirstore'"):
        check_store_url("dirstore:///tmp/x")
    _forget_plugins()


def test_the_public_conformance_machine_passes_on_the_plugin(with_plugin: Path, tmp_path: Path) -> None:
    def fresh() -> object:
        return open_store(f"dirstore://{tmp_path}/{uuid.uuid4().hex}?capacity=64MiB")

    run_state_machine_as_test(make_store_machine(fresh, allows_eviction=False))  # type: ignore[arg-type]


def test_the_chaos_view_wraps_the_plugin(with_plugin: Path, tmp_path: Path) -> None:
    def fresh() -> object:
        return open_store(
            f"faulty+dirstore://{tmp_path}/{uuid.uuid4().hex}?capacity=64MiB&corrupt=0.2&get_fail=0.1&seed=5"
        )

    run_state_machine_as_test(
        make_store_machine(fresh, allows_eviction=False, allows_corruption=True, allows_failures=True)  # type: ignore[arg-type]
    )


def test_its_urls_are_checked_like_a_builtins(with_plugin: Path, tmp_path: Path) -> None:
    assert "dirstore" in known_schemes()
    assert store_kind("faulty+dirstore:///x").scheme == "dirstore"
    with pytest.raises(StoreError, match="capasity.*did you mean 'capacity'"):
        check_store_url(f"dirstore://{tmp_path}/s?capasity=1GiB")
    with pytest.raises(StoreError, match="checksum"):
        check_store_url(f"dirstore://{tmp_path}/s?checksum=md5")
    with pytest.raises(
        ValueError, match=r"kv_connector_extra_config\['store'\].*needs an absolute directory"
    ):
        ConnectorConfig.from_extra_config({"store": "dirstore://host/s"}, model="m")
    config = ConnectorConfig.from_extra_config({"store": f"dirstore://{tmp_path}/s"}, model="m")
    assert config.store == f"dirstore://{tmp_path}/s"
    assert not (tmp_path / "s").exists(), "checking the URL opened the store"
    # An operator's open refuses a path that holds no store of the plug-in's, as for file://.
    with pytest.raises(StoreError, match="no dirstore at"):
        open_store(f"dirstore://{tmp_path}/s", operator=True)


def test_describe_reports_a_plugin_store(with_plugin: Path, tmp_path: Path) -> None:
    url = f"dirstore://{tmp_path}/s?capacity=1MiB"
    store = open_store(url)
    store.put(["a"], [b"x" * 100])
    store.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(with_plugin), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "describe", "--store", url, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["health"]["reachable"], report["health"]
    assert json.dumps(report).count("dirstore://") >= 1, report


def _write_distribution(site: Path, name: str, entry_points: str, module: str | None = None) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[hybridkv.stores]\n{entry_points}\n")
    if module is not None:
        (site / f"{name}.py").write_text(module)


def test_a_broken_plugin_is_named_and_breaks_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    _write_distribution(site, "broken_store_import", "brokenimport = broken_store_missing:KIND")
    _write_distribution(site, "broken_store_type", "brokentype = broken_store_type:KIND", "KIND = 42\n")
    _write_distribution(site, "broken_store_builtin", "file = broken_store_type:KIND")
    _forget_plugins()
    monkeypatch.syspath_prepend(str(site))
    try:
        with pytest.raises(StoreError, match=r"brokenimport = broken_store_missing:KIND.*failed to load"):
            check_store_url("brokenimport:///x")
        with pytest.raises(StoreError, match=r"brokentype.*is a int, not a hybridkv.store.kinds.StoreKind"):
            check_store_url("brokentype:///x")
        assert "brokentype" not in known_schemes()
        # The built-in file store is served as ever: a plug-in cannot take its scheme.
        assert (
            plugin_kinds(frozenset(("memory", "file", "mooncake")))
            .scheme_to_refusal["file"]
            .endswith("it takes the built-in scheme 'file'")
        )
        store = open_store(f"file://{tmp_path}/store")
        assert store.put(["k"], [b"v"])[0].is_ok
        store.close()
    finally:
        monkeypatch.undo()
        _forget_plugins()


_ENGINE_CHILD = r"""
import json, sys
from pathlib import Path

tests_dir, root = sys.argv[1], Path(sys.argv[2])
sys.path.insert(0, tests_dir)
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, audit, engine, flush_saves, generate, prompt, reset_local_cache

model = build_tiny_model("llama", MODELS_DIR)
log_path = root / "audit.jsonl"
extra = {"store": f"dirstore://{root}/store?capacity=256MiB", "audit_log": str(log_path)}
tokens = prompt(300, seed=7)
with engine(model, extra) as llm:
    cold, _ = generate(llm, tokens)
    flush_saves(llm)
    reset_local_cache(llm)
    warm, cached = generate(llm, tokens)
verified = sum(1 for record in audit(log_path) if record.get("dst") == "VERIFIED")
print(json.dumps({"cold": cold, "warm": warm, "cached": cached, "verified": verified,
                  "num_files": len(list((root / "store" / "keys").iterdir()))}))
"""


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_saves_to_and_hits_a_plugin_store(installed_plugin: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(installed_plugin), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _ENGINE_CHILD, str(_TESTS_DIR), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_files"] > 0, f"nothing was saved to the plug-in store: {result}"
    assert result["cached"] > 0, f"the resend did not hit the plug-in store: {result}"
    assert result["verified"] >= 1, f"no load was verified: {result}"
    assert result["warm"] == result["cold"], "tokens differ after a hit from the plug-in store"
