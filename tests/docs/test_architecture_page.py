"""docs/architecture.md: the map matches the house.

- every "hard rule N" the source cites is in the page's numbered list;
- every ``unit/file.py`` the page names exists under ``src/``, and every ``file.py: name`` (a function, class or
  method, ``Class.method`` too) is defined in that file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PAGE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _rules_listed() -> set[int]:
    section = PAGE.split("## Hard rules", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)}


def test_every_cited_hard_rule_is_listed() -> None:
    cited: dict[int, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for match in re.finditer(r"hard rule (\d+)", path.read_text(encoding="utf-8"), flags=re.IGNORECASE):
            cited.setdefault(int(match[1]), []).append(str(path.relative_to(ROOT)))
    listed = _rules_listed()
    assert listed == set(range(1, len(listed) + 1)), f"the hard rules are not numbered 1..n: {sorted(listed)}"
    missing = {rule: where for rule, where in cited.items() if rule not in listed}
    assert not missing, f"the source cites hard rules docs/architecture.md does not list: {missing}"


def _defined_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(
                    f"{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                )
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_every_named_file_and_definition_exists() -> None:
    files = set(
        re.findall(
            r"`((?:lifecycle|audit|store|connector|ops|cli|testing|devkit|bench|demo)/[a-z_]+\.py)", PAGE
        )
    )
    assert files, "the page names no source file"
    missing_files = sorted(f for f in files if not (SRC / f).is_file())
    assert not missing_files, f"docs/architecture.md names files that do not exist: {missing_files}"
    missing: list[str] = []
    # `unit/file.py: Name` (one backtick span; several names separated by ", " inside it)
    for file, names in re.findall(r"`([a-z_]+/[a-z_]+\.py): ([^`]+)`", PAGE):
        defined = _defined_names(SRC / file)
        missing.extend(f"{file}: {name}" for name in names.split(", ") if name.strip() not in defined)
    assert not missing, f"docs/architecture.md names definitions that do not exist: {missing}"
