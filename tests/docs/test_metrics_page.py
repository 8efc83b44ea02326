"""docs/metrics.md: it lists exactly the stats keys and Prometheus series the connector exports, and the hit
``source`` per store scheme the connector reports to vLLM."""

from __future__ import annotations

import functools
import re

import pytest
from support.docs import DOCS, all_blocks, names, table_rows


def stat_names() -> set[str]:
    """Every name the connector's stats may carry: its counter and gauge tables (``add`` refuses others)."""
    from hybridkv.connector import stats

    per_tenant = {f"{name}.<NS>" for name in (*stats.PER_TENANT_COUNTERS, *stats.PER_TENANT_GAUGES)}
    return {*stats.PROM_COUNTERS, *stats.GAUGES, f"{stats.PER_GROUP_LOADED_BLOCKS}<N>", *per_tenant}


def metrics_rows() -> dict[str, tuple[str, str]]:
    """stats key -> (Prometheus series, type) from docs/metrics.md's table."""
    return {
        names(row[0])[0]: (names(row[1])[0], row[2]) for row in table_rows(DOCS / "metrics.md", "stats key")
    }


@pytest.mark.vllm
def test_every_stat_is_documented() -> None:
    pytest.importorskip("vllm")
    from hybridkv.connector.stats import StatsBox

    missing = stat_names() - set(metrics_rows())
    assert not missing, f"docs/metrics.md does not document {sorted(missing)}"
    # The tables are the whole vocabulary: a counter the code adds under another name is refused.
    box = StatsBox()
    box.add("load_keys")
    box.add("loaded_blocks.g3", 16)
    box.add("tenant_refused_puts.team-a")
    for name in ("load_key", "loaded_blocks.gx", "hit_tokens.", "tenant_refused_puts.a/b"):
        with pytest.raises(AssertionError, match="neither PROM_COUNTERS nor GAUGES"):
            box.add(name)
    assert box.totals == {"load_keys": 1, "loaded_blocks.g3": 16, "tenant_refused_puts.team-a": 1}


@pytest.mark.vllm
def test_metrics_doc_matches_the_exported_series() -> None:
    """Build the connector's Prometheus metrics on a private registry and compare with the docs table."""
    pytest.importorskip("vllm")
    from hybridkv.connector import stats
    from hybridkv_dev.devkit.cluster import make_vllm_objs
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = stats.build_prom(
        make_vllm_objs()["vc"],
        metric_types,
        ["model_name", "engine"],
        {0: ["doc-model", "0"]},
    )
    rows = metrics_rows()
    documented_keys = set(rows)
    exported_keys = stat_names()
    assert documented_keys == exported_keys, (
        f"docs/metrics.md keys differ: missing {exported_keys - documented_keys}, extra {documented_keys - exported_keys}"
    )
    prom.observe({key.replace("<N>", "0").replace("<NS>", "team-a"): 1 for key in documented_keys}, 0)
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
