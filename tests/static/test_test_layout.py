"""The tests' own layout: shared helpers live in the ``tests/support`` package, and nothing else is shared.

Every ``.py`` file under ``tests/`` is parsed with ``ast``; imports count at module level, inside functions
and under ``TYPE_CHECKING`` alike.

- No file edits ``sys.path`` (``sys.path.insert`` / ``append`` / ``extend``, an assignment to it, or
  ``from sys import path``): ``tests/`` is on the path through ``pythonpath`` in
  ``[tool.pytest.ini_options]``, and scripts the tests start get it through ``PYTHONPATH``
  (``support.paths.subprocess_env``).
- No file imports a test module (``test_*``) or a ``conftest`` (fixtures reach tests through pytest), and no
  module under ``tests/`` other than ``support`` (a sibling file, a relative import, ``tests.<...>``).
- Nothing imported from ``support`` has a private name (``_x``), and every name imported from
  ``support.<module>`` is defined at that module's top level: the scripts the tests run as subprocesses
  (``tests/multihost/engine_proc.py``, ...) are never imported by the collection, so a stale name there
  would only show in a slow run.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SUPPORT = "support"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _local_names(tests: Path) -> set[str]:
    """Top-level module names that would reach into the test tree past ``support``: the stems of the files
    under ``tests/`` and the names of its folders (``tests/`` and each test folder are, or were, on
    ``sys.path``; ``from cluster import ...`` once found ``tests/multihost/cluster.py``), less the names of
    the standard library and of installed distributions (``operator``; ``mooncake``, the Mooncake wheel's
    package, next to ``support/mooncake.py``)."""
    names = {p.stem for p in tests.rglob("*.py")} | {p.name for p in tests.rglob("*") if p.is_dir()}
    names = {n for n in names if n.isidentifier()}
    names -= set(sys.stdlib_module_names) | set(packages_distributions())
    return (names - {SUPPORT}) | {"tests", "conftest"}


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _top_level_names(path: Path) -> set[str]:
    """What ``from <module> import NAME`` can find in ``path``: top-level defs, classes, assignments and
    imports, including those under a top-level ``if`` / ``try``."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return names


def check(
    source: str, where: str, *, in_support: bool, local: set[str], support_dir: Path
) -> Iterator[Finding]:
    """The layout rules broken by one file's ``source`` (``where`` names it in the findings)."""
    tree = ast.parse(source, filename=where)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_sys_path(node.func.value)
        ):
            yield Finding(where, line, f"sys.path.{node.func.attr}(...): put the helper in tests/support")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if _is_sys_path(target) or (isinstance(target, ast.Subscript) and _is_sys_path(target.value)):
                    yield Finding(where, line, "assignment to sys.path")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield from _check_module(alias.name, (), where, line, local, support_dir)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level:
                if not in_support:
                    yield Finding(where, line, f"relative import from {'.' * node.level}{node.module or ''}")
                continue
            module = node.module or ""
            if module == "sys" and "path" in names:
                yield Finding(where, line, "from sys import path")
            yield from _check_module(module, names, where, line, local, support_dir)


def _check_module(
    module: str, names: tuple[str, ...], where: str, line: int, local: set[str], support_dir: Path
) -> Iterator[Finding]:
    parts = module.split(".")
    if any(p.startswith("test_") for p in parts) or "conftest" in parts:
        yield Finding(
            where, line, f"imports {module}: a test module or conftest (share through tests/support)"
        )
    elif parts[0] in local:
        yield Finding(where, line, f"imports {module}: a module of the test tree outside tests/support")
    elif parts[0] == SUPPORT:
        private = [n for n in names if n.startswith("_")]
        if private:
            yield Finding(where, line, f"imports private {', '.join(private)} from {module}")
        if len(parts) > 1:
            target = support_dir.joinpath(*parts[1:])
            file = target.with_suffix(".py") if target.with_suffix(".py").exists() else target / "__init__.py"
            if not file.exists():
                yield Finding(where, line, f"imports {module}: no such module under tests/support")
            elif names and names != ("*",):
                missing = sorted(set(names) - _top_level_names(file))
                if missing:
                    yield Finding(where, line, f"{module} defines no {', '.join(missing)}")


def _findings(tests: Path) -> list[Finding]:
    local = _local_names(tests)
    support_dir = tests / SUPPORT
    found: list[Finding] = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests.parent)
        in_support = support_dir in path.parents
        found.extend(
            check(path.read_text(), str(rel), in_support=in_support, local=local, support_dir=support_dir)
        )
    return found


def test_no_sys_path_edits_and_no_imports_between_test_modules() -> None:
    found = _findings(TESTS)
    assert not found, "test layout broken:\n" + "\n".join(map(str, found))


def test_support_is_a_package_of_public_helpers() -> None:
    assert (TESTS / SUPPORT / "__init__.py").exists()
    assert not (TESTS / "__init__.py").exists(), "tests/ is a folder on sys.path, not a package"
    for path in sorted((TESTS / SUPPORT).rglob("*.py")):
        assert not path.name.startswith(("test_", "conftest")), (
            f"{path}: tests and fixtures stay out of support"
        )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import sys\nsys.path.insert(0, 'x')\n", "sys.path.insert"),
        ("import sys\ndef f():\n    sys.path.append('x')\n", "sys.path.append"),
        ("import sys\nsys.path[:0] = ['x']\n", "assignment to sys.path"),
        ("from sys import path\n", "from sys import path"),
        ("from test_worker import wait_loads\n", "a test module"),
        ("def f():\n    from test_worker import wait_loads\n", "a test module"),
        ("import connector.test_worker\n", "a test module"),
        ("from .conftest import freeze_until_stopped\n", "relative import"),
        ("from conftest import x\n", "a test module or conftest"),
        ("from cluster import Cluster\n", "outside tests/support"),
        ("from engine_proc import main\n", "outside tests/support"),
        ("import e2e.engine_utils\n", "outside tests/support"),
        ("from tests.support.engines import MODELS_DIR\n", "outside tests/support"),
        ("from support.scheduler import _fill\n", "private _fill"),
        ("from support.scheduler import no_such_helper\n", "defines no no_such_helper"),
        ("from support.no_such_module import x\n", "no such module"),
    ],
)
def test_the_check_catches(source: str, expected: str) -> None:
    found = list(
        check(source, "x.py", in_support=False, local=_local_names(TESTS), support_dir=TESTS / SUPPORT)
    )
    assert any(expected in f.what for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "import operator\nimport json\n",
        "from mooncake.store import MooncakeDistributedStore\n",
        "from support.scheduler import make_request, tokens\n",
        "from support.engines import MODELS_DIR\n",
        "from hybridkv_dev.devkit.cluster import kv_cache_config as _kv_cache_config\n",
        "import sys\nprint(sys.path)\n",
    ],
)
def test_the_check_lets_through(source: str) -> None:
    found = list(
        check(source, "x.py", in_support=False, local=_local_names(TESTS), support_dir=TESTS / SUPPORT)
    )
    assert not found, found
