"""Product and tooling apart: which of hybridkv's top-level units may import which (read from the source).

Every module under ``src/`` is parsed with ``ast``; every ``import`` / ``from ... import`` naming
``hybridkv.*`` counts, at module level, inside functions and under ``TYPE_CHECKING`` alike. Units are the
top-level subpackages (``hybridkv.store``) and top-level modules (``hybridkv.tables``; ``hybridkv`` itself
is ``__init__``).

- The product (what ``vllm`` loads and what operators run: lifecycle, audit, store, connector, the operator
  wing ``hybridkv.ops``, the CLI, the public fuzzers in ``hybridkv.testing``) never imports the tooling
  (``hybridkv.devkit``, ``hybridkv.bench``, ``hybridkv.demo``), except the few CLI command functions in
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

SRC = Path(__file__).resolve().parents[2] / "src"

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
TOOLING = {"devkit", "bench", "demo"}

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
    "devkit": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector", "testing", "ops"},
    "bench": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector", "devkit", "ops"},
    "demo": {"tables", "key_grammar", "lifecycle", "audit", "store", "connector", "devkit", "ops"},
}

#: The CLI's tooling subcommands (``hybridkv bench ...``, ``hybridkv demo``) are front ends of benchmarks
#: and of the demo, which run on the devkit's tiny models and deployments. They are how the benches are run,
#: but no other command may load tooling: so these command functions, and nothing else in the CLI, import
#: tooling, lazily, when that command runs. (CLI module, function) -> the tooling modules it imports.
CLI_TOOLING_COMMANDS: dict[tuple[str, str], set[str]] = {
    ("hybridkv.cli.agentic_cmds", "handle_agentic"): {"hybridkv.bench.agentic", "hybridkv.bench.report"},
    ("hybridkv.cli.agentic_cmds", "handle_agentic_policies"): {
        "hybridkv.bench.agentic",
        "hybridkv.bench.agentic_policies",
        "hybridkv.bench.report",
    },
    ("hybridkv.cli.agentic_serve_cmds", "handle_agentic_serve"): {
        "hybridkv.bench.agentic_serve",
        "hybridkv.bench.report",
    },
    ("hybridkv.cli.divergent_cmds", "handle_divergent"): {
        "hybridkv.bench.divergent",
        "hybridkv.bench.report",
    },
    ("hybridkv.cli.datapath_cmds", "handle_bench"): {"hybridkv.bench.datapath"},
    ("hybridkv.cli.scale_cmds", "handle_scale"): {"hybridkv.bench.scale", "hybridkv.bench.report"},
    ("hybridkv.cli.scale_cmds", "handle_mooncake_entries"): {
        "hybridkv.bench.scale_mooncake",
        "hybridkv.bench.report",
    },
    ("hybridkv.cli.scale_cmds", "handle_prompt_length"): {
        "hybridkv.bench.scale_prompt",
        "hybridkv.bench.report",
    },
    ("hybridkv.cli.demo_cmds", "handler"): {"hybridkv.demo", "hybridkv.bench.report"},
    ("hybridkv.cli.lifecycle_cmds", "_bench"): {"hybridkv.bench.lifecycle", "hybridkv.bench.report"},
    ("hybridkv.cli.mooncake_cmds", "handle_bench"): {"hybridkv.bench.crosshost", "hybridkv.bench.report"},
    # The one registration allowed in: ``bench serve``'s flags show the defaults of the bench's own
    # ``Workload`` / ``ServerShape`` and its configuration and family names (a dozen values that would
    # otherwise be copied here and drift). It runs when the parser is built; bench.serve and tiny_models
    # import no vLLM, no torch.
    ("hybridkv.cli.serve_cmds", "register"): {"hybridkv.bench.serve", "hybridkv.devkit.tiny_models"},
    ("hybridkv.cli.serve_cmds", "handle_serve"): {"hybridkv.bench.serve", "hybridkv.devkit.tiny_models"},
    ("hybridkv.cli.serve_cmds", "_one_run"): {"hybridkv.bench.serve", "hybridkv.bench.report"},
    ("hybridkv.cli.serve_cmds", "_print_summary"): {"hybridkv.bench.serve", "hybridkv.bench.report"},
    ("hybridkv.cli.soak_cmds", "handle_soak"): {
        "hybridkv.bench.soak",
        "hybridkv.bench.report",
        "hybridkv.devkit.tiny_models",
    },
    ("hybridkv.cli.store_cmds", "handle_bench"): {"hybridkv.bench.store", "hybridkv.bench.report"},
    # The model sizes its --size offers (tiny_models imports no vLLM, no torch at module level).
    ("hybridkv.cli.ttft_cmds", "register"): {"hybridkv.devkit.tiny_models"},
    ("hybridkv.cli.ttft_cmds", "handle_ttft"): {
        "hybridkv.bench.ttft",
        "hybridkv.bench.report",
        "hybridkv.devkit.net",
        "hybridkv.devkit.tiny_models",
    },
    ("hybridkv.cli.ttft_cmds", "handle_lookup"): {
        "hybridkv.bench.lookup",
        "hybridkv.bench.report",
        "hybridkv.bench.store",
        "hybridkv.devkit.tiny_models",
    },
    ("hybridkv.cli.ttft_cmds", "_inflight_wanted"): {"hybridkv.bench.scheduler_inflight"},
    ("hybridkv.cli.ttft_cmds", "_inflight_axis"): {"hybridkv.bench.scheduler_inflight"},
    ("hybridkv.cli.ttft_cmds", "handle_scheduler"): {
        "hybridkv.bench.scheduler",
        "hybridkv.bench.report",
        "hybridkv.devkit.delayed_mooncake",
        "hybridkv.devkit.tiny_models",
    },
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
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["hybridkv", *parts])


def _is_module(name: str) -> bool:
    """Whether ``hybridkv.a.b`` names a module or package under ``src/`` (not an attribute of one)."""
    relative = Path(*name.split(".")[1:]) if name != "hybridkv" else Path()
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


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
        if found.target == "hybridkv" or found.target.startswith("hybridkv."):
            yield found


def _unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


ALL_IMPORTS = sorted(
    {found for path in sorted(SRC.rglob("*.py")) for found in _imports(path)},
    key=lambda f: (f.module, f.line, f.target),
)


def test_the_scan_sees_the_package() -> None:
    units = {_unit(found.module) for found in ALL_IMPORTS}
    assert {"connector", "ops", "cli", "bench", "devkit", "demo"} <= units, units
    assert any(f.target.startswith("hybridkv.bench.") and f.function for f in ALL_IMPORTS), (
        "lazy imports seen"
    )
    for key, targets in CLI_TOOLING_COMMANDS.items():
        for target in targets:
            assert _is_module(target), f"{key}: {target} is not a module"


def test_every_unit_is_placed() -> None:
    units = {_unit(_module_name(path)) for path in SRC.rglob("*.py")}
    assert units <= set(ALLOWED), f"place {sorted(units - set(ALLOWED))} in ALLOWED (and PRODUCT or TOOLING)"
    assert set(ALLOWED) == PRODUCT | TOOLING


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
