"""The Grafana dashboard (dashboards/hybridkv.json) and its provisioning files: every panel queries series the
connector (or vLLM itself) exports, and every hybridkv series has a panel."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hybridkv.connector.stats import GAUGES, PER_TENANT_COUNTERS, PER_TENANT_GAUGES, PROM_COUNTERS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
#: vLLM's own prefix-cache series the dashboard sets next to hybridkv's (vllm/v1/metrics/loggers.py).
VLLM_SERIES = {
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
}


def _dashboard() -> dict[str, Any]:
    return json.loads((DASHBOARDS / "hybridkv.json").read_text())


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and every query variable."""
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"variable {variable['name']}", variable["query"]["query"]))
    return queries


def hybridkv_series() -> set[str]:
    """The names the connector's Prometheus metrics (hybridkv.connector.stats.build_prom) are scraped as."""
    counters = {f"{name}_total" for name, _ in PROM_COUNTERS.values()}
    counters |= {f"{name}_total" for name, _, _ in PER_TENANT_COUNTERS.values()}
    gauges = {name for name, _ in GAUGES.values()} | {name for name, _ in PER_TENANT_GAUGES.values()}
    return counters | gauges | {"vllm:hybridkv_group_loaded_blocks_total"}


def test_every_query_names_an_exported_series() -> None:
    exported = hybridkv_series() | VLLM_SERIES
    dashboard = _dashboard()
    used: set[str] = set()
    for title, expr in _queries(dashboard):
        names = set(_SERIES.findall(expr))
        assert names, f"panel {title!r}: query {expr!r} names no vllm: series"
        unknown = names - exported
        assert not unknown, f"panel {title!r}: {sorted(unknown)} is not exported"
        used |= names
    assert hybridkv_series() <= used, f"no panel for {sorted(hybridkv_series() - used)}"
    assert VLLM_SERIES <= used


def test_panels_are_well_formed() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "hybridkv-overview"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert '{model_name=~"$model_name"}' in target["expr"], f"{panel['title']}: not filtered by model"


def test_provisioning_points_at_the_dashboards() -> None:
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards.yaml").read_text())
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file"
    mount = entry["options"]["path"]
    # The documented `docker run` mounts this repository's dashboards/ folder exactly there.
    metrics_doc = (ROOT / "docs" / "metrics.md").read_text()
    assert f'dashboards:{mount}"' in metrics_doc, f"docs/metrics.md does not mount dashboards/ at {mount}"
    assert "provisioning/dashboards.yaml:/etc/grafana/provisioning/dashboards/" in metrics_doc
    sources = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources.yaml").read_text())
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]


@pytest.mark.slow
@pytest.mark.vllm
def test_series_match_a_real_vllm_registry() -> None:
    """vLLM's own Prometheus logger, built for an engine with the connector, registers exactly the series
    the dashboard expects (hybridkv's and vLLM's prefix-cache ones)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import prometheus_client
    from hybridkv.demo.tiny_models import build_tiny_model
    from support.engines import MODELS_DIR
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    model = build_tiny_model("llama", MODELS_DIR)
    config = EngineArgs(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_connector_module_path="hybridkv.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"store": "memory://"},
        ),
    ).create_engine_config()
    logger = PrometheusStatLogger(config, [0])
    # Per-group and per-tenant children exist once observed.
    per_tenant = (
        "tenant_usage_bytes",
        "tenant_quota_evicted",
        "tenant_capacity_evicted",
        "tenant_refused_puts",
    )
    logger.kv_connector_prom.observe({"loaded_blocks.g0": 16, **{f"{n}.ns": 1 for n in per_tenant}}, 0)
    names = {s.name for family in prometheus_client.REGISTRY.collect() for s in family.samples}
    exported = {n for n in names if n.startswith("vllm:hybridkv_") or "prefix_cache" in n}
    dashboard_series = {name for _, expr in _queries(_dashboard()) for name in _SERIES.findall(expr)}
    assert dashboard_series <= exported, f"not in vLLM's registry: {sorted(dashboard_series - exported)}"
    # (a counter's samples are `_total` and `_created`; a gauge's, its bare name)
    assert hybridkv_series() == {
        n for n in exported if n.startswith("vllm:hybridkv_") and not n.endswith("_created")
    }
