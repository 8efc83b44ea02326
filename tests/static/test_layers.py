"""Product and tooling apart: which of hybridkv's top-level units may import which (read from the source).

Every module under ``src/`` (the runtime package ``hybridkv``) and ``dev/hybridkv_dev`` (the development
distribution) is parsed with ``ast``; every ``import`` / ``from ... import`` naming ``hybridkv.*`` or
``hybridkv_dev.*`` counts, at module level, inside functions and under ``TYPE_CHECKING`` alike. Units are the
top-level subpackages (``hybridkv.store``) and top-level modules (``hybridkv.tables``; ``hybridkv`` itself
is ``__init__``); the whole development distribution is one unit, ``dev``.

- Nothing in ``hybridkv`` imports ``hybridkv_dev``: the runtime wheel stands alone.

- The product (what ``vllm`` loads and what operators run: lifecycle, audit, store, connector, the operator
  wing ``hybridkv.ops``, the CLI, the public fuzzers in ``hybridkv.testing``) never imports the tooling
  (``hybridkv.bench``, ``hybridkv.demo``, the development distribution), except the few CLI command functions in
  ``CLI_TOOLING_COMMANDS``.
- ``hybridkv.bench`` never imports ``hybridkv.cli``.
- Inside the connector, the scheduler, worker and data-path wings never import each other (the worker drives
  the data path; ``CONNECTOR_WINGS``).
- Each unit imports only the units below it (``ALLOWED``): the key grammar (``hybridkv.key_grammar``) on the
  ground floor, lifecycle above it, store beside lifecycle (it never imports it),
  connector above both, the operator wing (ops) above it, the CLI and the tooling on top; and the unit graph
  has no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DEV = ROOT / "dev"
#: top-level package -> the folder it is read from
PACKAGE_ROOTS = {"hybridkv": SRC, "hybridkv_dev": DEV / "hybridkv_dev"}

PRODUCT = {
    "__init__",
    "tables",
    "key_grammar",
    "lifecycle",
    "audit",
    "store",
    "connector",
    "testing",
    "ops",
    "cli",
}
TOOLING = {"bench", "demo", "dev"}

#: The units each unit may import (besides itself). A unit missing here fails the test: place it.
ALLOWED: dict[str, set[str]] = {
    "__init__": set(),
    "tables": set(),
    "key_grammar": set(),
    "lifecycle": {"key_grammar"},
    # The store moves bytes: it reads the key grammar from the ground floor, never the decision layer.
    "store": {"key_grammar"},
    "audit": {"key_grammar", "lifecycle", "store"},
    "connector": {"key_grammar", "lifecycle", "audit", "store"},
    "testing": {"key_grammar", "lifecycle", "audit", "store", "connector"},
    "ops": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector"},
    "cli": {"__init__", "tables", "key_grammar", "lifecycle", "audit", "store", "connector", "ops"},
    # The benches an operator runs against their own deployment (store, data path, cross-host Mooncake).
    "bench": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector", "ops", "demo"},
    # The demo and the tiny random-weight models it (and the benches) run on.
    "demo": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector", "ops"},
    # The development distribution builds on the whole product.
    "dev": {
        "__init__",
        "tables",
        "key_grammar",
        "lifecycle",
        "audit",
        "store",
        "connector",
        "testing",
        "ops",
        "cli",
        "bench",
        "demo",
    },
}

#: The CLI's tooling subcommands (``hybridkv bench ...``, ``hybridkv demo``) are front ends of benchmarks
#: and of the demo, which run on the demo's tiny models. They are how the benches are run,
#: but no other command may load tooling: so these command functions, and nothing else in the CLI, import
#: tooling, lazily, when that command runs. (CLI module, function) -> the tooling modules it imports.
CLI_TOOLING_COMMANDS: dict[tuple[str, str], set[str]] = {
    ("hybridkv.cli.datapath_cmds", "handle_bench"): {"hybridkv.bench.datapath"},
    ("hybridkv.cli.demo_cmds", "handler"): {"hybridkv.demo", "hybridkv.bench.report"},
    ("hybridkv.cli.lifecycle_cmds", "_bench"): {"hybridkv.bench.lifecycle", "hybridkv.bench.report"},
    ("hybridkv.cli.mooncake_cmds", "handle_bench"): {"hybridkv.bench.crosshost", "hybridkv.bench.report"},
    ("hybridkv.cli.store_cmds", "handle_bench"): {"hybridkv.bench.store", "hybridkv.bench.report"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. hybridkv.cli.store_cmds
    function: str | None  # the outermost function the import sits in; None at module level
    target: str  # the imported module, e.g. hybridkv.bench.report
    line: int

    def __str__(self) -> str:
        where = f"{self.module}:{self.line}" + (f" (in {self.function})" if self.function else "")
        return f"{where} imports {self.target}"


def _module_name(path: Path) -> str:
    for package, folder in PACKAGE_ROOTS.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise AssertionError(f"{path} is in no package root")


def _is_module(name: str) -> bool:
    """Whether ``hybridkv.a.b`` (or ``hybridkv_dev.a.b``) names a module or package (not an attribute of one)."""
    package, *rest = name.split(".")
    folder = PACKAGE_ROOTS.get(package)
    if folder is None:
        return False
    relative = Path(*rest) if rest else Path()
    return (folder / relative).with_suffix(".py").is_file() or (folder / relative / "__init__.py").is_file()


def _sources() -> list[Path]:
    return sorted(path for folder in PACKAGE_ROOTS.values() for path in folder.rglob("*.py"))


def _imports(path: Path) -> Iterator[Import]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))

    def visit(node: ast.AST, function: str | None) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, function or child.name)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(module, function, alias.name, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in child.names:
                    candidate = f"{base}.{alias.name}"
                    yield Import(module, function, candidate if _is_module(candidate) else base, child.lineno)
            yield from visit(child, function)

    for found in visit(tree, None):
        if found.target.split(".")[0] in PACKAGE_ROOTS:
            yield found


def _unit(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "hybridkv_dev":
        return "dev"
    return parts[1] if len(parts) > 1 else "__init__"


ALL_IMPORTS = sorted(
    {found for path in _sources() for found in _imports(path)},
    key=lambda f: (f.module, f.line, f.target),
)


def test_the_scan_sees_the_package() -> None:
    units = {_unit(found.module) for found in ALL_IMPORTS}
    assert {"connector", "ops", "cli", "bench", "demo", "dev"} <= units, units
    assert any(f.target.startswith("hybridkv_dev.") and _unit(f.module) == "dev" for f in ALL_IMPORTS), (
        "the development distribution seen"
    )
    assert any(f.target.startswith("hybridkv.bench.") and f.function for f in ALL_IMPORTS), (
        "lazy imports seen"
    )
    for key, targets in CLI_TOOLING_COMMANDS.items():
        for target in targets:
            assert _is_module(target), f"{key}: {target} is not a module"


def test_every_unit_is_placed() -> None:
    units = {_unit(_module_name(path)) for path in _sources()}
    assert units <= set(ALLOWED), f"place {sorted(units - set(ALLOWED))} in ALLOWED (and PRODUCT or TOOLING)"
    assert set(ALLOWED) == PRODUCT | TOOLING


def test_the_runtime_package_never_imports_the_development_distribution() -> None:
    """``pip install hybridkv`` installs no ``hybridkv_dev``: nothing of the wheel may need it."""
    bad = [str(f) for f in ALL_IMPORTS if _unit(f.module) != "dev" and _unit(f.target) == "dev"]
    assert not bad, "the runtime package imports the development distribution:\n" + "\n".join(bad)


def test_the_product_never_imports_tooling() -> None:
    bad = []
    for found in ALL_IMPORTS:
        if _unit(found.module) not in PRODUCT or _unit(found.target) not in TOOLING:
            continue
        allowed = CLI_TOOLING_COMMANDS.get((found.module, found.function or ""), set())
        if found.target not in allowed:
            bad.append(str(found))
    assert not bad, "product imports tooling:\n" + "\n".join(bad)


def test_the_tooling_commands_whitelist_is_exact() -> None:
    """Every whitelisted (command, module) is still imported there: no stale permission stays behind."""
    seen = {
        ((found.module, found.function), found.target)
        for found in ALL_IMPORTS
        if _unit(found.module) == "cli" and _unit(found.target) in TOOLING
    }
    stale = [(key, target) for key, targets in CLI_TOOLING_COMMANDS.items() for target in targets]
    stale = [entry for entry in stale if entry not in seen]
    assert not stale, f"whitelisted but not imported (remove): {stale}"


def test_bench_never_imports_the_cli() -> None:
    bad = [str(f) for f in ALL_IMPORTS if _unit(f.module) == "bench" and _unit(f.target) == "cli"]
    assert not bad, "\n".join(bad)


def _unit_graph(*, with_whitelisted: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for found in ALL_IMPORTS:
        source, target = _unit(found.module), _unit(found.target)
        whitelisted = found.target in CLI_TOOLING_COMMANDS.get((found.module, found.function or ""), set())
        if source != target and (with_whitelisted or not whitelisted):
            graph.setdefault(source, set()).add(target)
    return graph


def test_units_import_only_units_below_them() -> None:
    bad = []
    for source, targets in sorted(_unit_graph(with_whitelisted=False).items()):
        for target in sorted(targets - ALLOWED.get(source, set())):
            where = [str(f) for f in ALL_IMPORTS if _unit(f.module) == source and _unit(f.target) == target]
            bad.append(f"{source} -> {target}: " + "; ".join(where[:3]))
    assert not bad, "\n".join(bad)


def test_no_import_cycle_among_units() -> None:
    graph = _unit_graph(with_whitelisted=True)
    state: dict[str, str] = {}

    def walk(unit: str, path: list[str]) -> None:
        state[unit] = "open"
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target] if target in path else [unit, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                walk(target, [*path, target])
        state[unit] = "done"

    for unit in sorted(graph):
        if unit not in state:
            walk(unit, [unit])


def test_lifecycle_is_at_the_bottom() -> None:
    """Below lifecycle only the key grammar, which imports nothing of hybridkv."""
    graph = _unit_graph(with_whitelisted=True)
    assert graph.get("lifecycle", set()) <= {"key_grammar"}, f"lifecycle imports {graph['lifecycle']}"
    assert not graph.get("key_grammar"), f"key_grammar imports {graph['key_grammar']}"


def test_the_store_imports_neither_the_lifecycle_nor_the_connector() -> None:
    """Backends move bytes: what they must know of a key comes from the ground floor."""
    graph = _unit_graph(with_whitelisted=True)
    assert not graph.get("store", set()) & {"lifecycle", "connector"}, f"store imports {graph['store']}"


#: The connector's wings (``hybridkv.connector.<wing>``) and the wings each may import. The scheduler and
#: the worker halves run in different processes and talk only through the step's metadata, so neither
#: imports the other; the data path (bytes between pages and values) is driven by the worker and imports
#: neither. The shared modules (``config``, ``metadata``, ``stats``, ...) import no wing; only the facade
#: vLLM instantiates (``hybridkv.connector.connector``, which the package's ``__init__`` hands out) assembles
#: the two halves.
CONNECTOR_WINGS: dict[str, set[str]] = {
    "scheduler": set(),
    "worker": {"datapath"},
    "datapath": set(),
    "shared": set(),
    "facade": {"scheduler", "worker"},
}


def _wing(module: str) -> str | None:
    """``hybridkv.connector.worker.side`` -> ``worker``; a shared module -> ``shared``; the package and its
    facade module -> ``facade``; outside the connector -> None."""
    parts = module.split(".")
    if parts[:2] != ["hybridkv", "connector"]:
        return None
    if len(parts) == 2 or parts[2] == "connector":
        return "facade"
    return parts[2] if parts[2] in CONNECTOR_WINGS else "shared"


def test_the_connector_wings_never_import_each_other() -> None:
    wings = {_wing(_module_name(path)) for path in (SRC / "connector").rglob("*.py")}
    assert {"scheduler", "worker", "datapath", "shared", "facade"} <= wings, f"the scan sees wings {wings}"
    bad = []
    for found in ALL_IMPORTS:
        source, target = _wing(found.module), _wing(found.target)
        if source is None or target is None or target in (source, "shared"):
            continue
        if target not in CONNECTOR_WINGS[source]:
            bad.append(f"{source} -> {target}: {found}")
    assert not bad, "imports across the connector's wings:\n" + "\n".join(bad)
