"""docs/metrics.md: it lists exactly the stats keys and Prometheus series the connector exports, and the hit
``source`` per store scheme the connector reports to vLLM."""

from __future__ import annotations

import ast
import functools
import re

import pytest
from doc_reader import DOCS, ROOT, all_blocks, names, table_rows


def emitted_stat_names() -> set[str]:
    """Names the connector puts into its stats: ``*.stats.add("name", ...)`` and ``stats.data["name"] = ...``."""
    found: set[str] = set()
    for source in sorted((ROOT / "src" / "connector").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            name_node = None
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add"
                and "stats" in ast.unparse(node.func.value)
                and node.args
            ):
                name_node = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("stats.data"):
                name_node = node.slice
            if isinstance(name_node, ast.Constant) and isinstance(name_node.value, str):
                found.add(name_node.value)
            elif isinstance(name_node, ast.JoinedStr):
                found.add(
                    "".join(str(v.value) if isinstance(v, ast.Constant) else "<N>" for v in name_node.values)
                )
    return found


def metrics_rows() -> dict[str, tuple[str, str]]:
    """stats key -> (Prometheus series, type) from docs/metrics.md's table."""
    return {
        names(row[0])[0]: (names(row[1])[0], row[2]) for row in table_rows(DOCS / "metrics.md", "stats key")
    }


def test_every_emitted_stat_is_documented() -> None:
    emitted = emitted_stat_names()
    assert {"lookups", "load_keys", "save_keys"} <= emitted, f"stats scan is broken: {sorted(emitted)}"
    missing = emitted - set(metrics_rows())
    assert not missing, f"docs/metrics.md does not document {sorted(missing)}"


@pytest.mark.vllm
def test_metrics_doc_matches_the_exported_series() -> None:
    """Build the connector's Prometheus metrics on a private registry and compare with the docs table."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from hybridkv.connector import stats
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = stats.build_prom(
        SimpleNamespace(kv_transfer_config=None),
        metric_types,
        ["model_name", "engine"],
        {0: ["doc-model", "0"]},
    )
    rows = metrics_rows()
    documented_keys = set(rows)
    exported_keys = {*stats.PROM_COUNTERS, *getattr(stats, "GAUGES", {}), "hit_tokens.g<N>"}
    assert documented_keys == exported_keys, (
        f"docs/metrics.md keys differ: missing {exported_keys - documented_keys}, extra {documented_keys - exported_keys}"
    )
    prom.observe({key.replace("<N>", "0"): 1 for key in documented_keys}, 0)
    exposition = generate_latest(registry).decode()
    series = {
        m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\w+)$", exposition, flags=re.MULTILINE)
    }
    for key, (documented, kind) in rows.items():
        base = documented.split("{")[0]
        # (the TYPE line names a counter with or without `_total`, depending on prometheus_client's version)
        assert kind in (series.get(base), series.get(base.removesuffix("_total"))), (
            f"{key}: {documented} ({kind}) is not exported; exported {series}"
        )
        assert re.search(rf"^{re.escape(base)}\{{", exposition, flags=re.MULTILINE), (
            f"{key}: no sample of {base}"
        )
        for label in re.findall(r"(\w+)=", documented):
            assert re.search(rf"^{re.escape(base)}\{{[^}}]*\b{label}=", exposition, flags=re.MULTILINE), (
                f"{key}: {base} has no label {label}"
            )
    exposed = set(re.findall(r"^(vllm:hybridkv_\w+?)\{", exposition, flags=re.MULTILINE))
    for block in all_blocks():
        if block.lang == "promql":
            for name in re.findall(r"vllm:hybridkv_\w+", block.text):
                assert name in exposed, f"{block.where}: {name} is not an exported series"


@pytest.mark.vllm
def test_documented_hit_sources() -> None:
    """docs/metrics.md's `source` per store scheme is what the connector reports to vLLM."""
    pytest.importorskip("vllm")
    from hybridkv.connector import connector

    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    pairs = re.findall(r"`(\w+)` for `(\w+)://`", text)
    assert {scheme for _, scheme in pairs} == {"file", "memory", "mooncake"}, pairs
    for source, scheme in pairs:
        for url in (f"{scheme}://x", f"faulty+{scheme}://x"):
            assert connector.hit_source(url).value == source, f"{url}: docs say {source}"
