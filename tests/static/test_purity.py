"""``hybridkv.lifecycle`` is pure logic: no threads, no files, no exit hooks, no compression, and nothing from
the layers built on it (the audit wing, the connector, the stores) or from vLLM / torch. Checked on the
source (AST of every ``src/lifecycle/*.py``), imports under ``TYPE_CHECKING`` and inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIFECYCLE = ROOT / "src" / "lifecycle"
MODULES = sorted(LIFECYCLE.glob("*.py"))

#: Modules (and their submodules) no lifecycle module may import.
FORBIDDEN = (
    # threads, exit hooks, queues, compression, log files
    "threading",
    "_thread",
    "concurrent",
    "multiprocessing",
    "asyncio",
    "subprocess",
    "atexit",
    "gzip",
    "bz2",
    "lzma",
    "zlib",
    "queue",
    "logging.handlers",
    # file IO
    "os",
    "pathlib",
    "io",
    "shutil",
    "tempfile",
    "glob",
    # the layers above, and the engine
    "hybridkv.audit",
    "hybridkv.connector",
    "hybridkv.store",
    "vllm",
    "torch",
)
#: Builtins that open or run something.
FORBIDDEN_CALLS = ("open", "exec", "eval", "__import__")


def _package(path: Path) -> str:
    return "hybridkv.lifecycle" if path.name == "__init__.py" else f"hybridkv.lifecycle.{path.stem}"


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; ``from a import b`` counts ``a`` and
    ``a.b`` (``b`` may be a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = _package(path).split(".")
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _forbidden(module: str) -> str | None:
    for name in FORBIDDEN:
        if module == name or module.startswith(f"{name}."):
            return name
    return None


def test_every_lifecycle_module_is_checked() -> None:
    assert LIFECYCLE.is_dir() and len(MODULES) >= 5, MODULES
    assert {"__init__.py", "machine.py", "sink.py"} <= {p.name for p in MODULES}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_lifecycle_module_imports_nothing_impure(path: Path) -> None:
    problems = [
        f"{path.name}:{line}: imports {module} ({rule})"
        for line, module in _imported(path)
        if (rule := _forbidden(module)) is not None
    ]
    assert not problems, "hybridkv.lifecycle must stay pure:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_lifecycle_module_opens_nothing(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    calls = [
        f"{path.name}:{node.lineno}: calls {node.func.id}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS
    ]
    assert not calls, "hybridkv.lifecycle must stay pure:\n" + "\n".join(calls)


def test_the_checker_catches_what_it_forbids(tmp_path: Path) -> None:
    """The AST walk sees plain, ``from``, relative, nested and ``TYPE_CHECKING`` imports."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os.path\n"
        "from logging import handlers\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from hybridkv.connector.config import ConnectorConfig\n"
        "def f():\n"
        "    import threading\n"
        "    from .. import audit\n"
        "    from vllm.config import VllmConfig\n",
        encoding="utf-8",
    )
    hits = {rule for _, module in _imported(probe) if (rule := _forbidden(module)) is not None}
    assert hits == {"os", "logging.handlers", "hybridkv.connector", "threading", "hybridkv.audit", "vllm"}
