"""dashboards/prometheus.yml and dashboards/alerts.yml: both parse; every series an alert names is one the
connector (or vLLM) exports -- the same source of truth as the Grafana dashboard's test,
tests/operator/test_dashboard.py's ``hybridkv_series`` (built from ``hybridkv.connector.stats``' tables and checked
there against vLLM's real registry); counters are only read through ``rate``/``increase``; every alert links an
existing section of docs/troubleshooting.md."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import yaml
from support.docs import DOCS, ROOT, anchors_of

DASHBOARDS = ROOT / "dashboards"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
_SERIES = re.compile(r"vllm:[A-Za-z0-9_:]+")
_LINK = re.compile(r"(?:docs/)?troubleshooting\.md#([\w-]+)")
_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w|y))+")
_RATE_FUNCTIONS = ("rate", "irate", "increase")


def _dashboard_test() -> ModuleType:
    """tests/operator/test_dashboard.py, loaded by path (a test directory is no package, and `operator` is a
    stdlib module name), for its ``hybridkv_series`` and ``VLLM_SERIES``."""
    path = ROOT / "tests" / "operator" / "test_dashboard.py"
    spec = importlib.util.spec_from_file_location("_hybridkv_dashboard_series", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_dashboard = _dashboard_test()
hybridkv_series: Callable[[], set[str]] = _dashboard.hybridkv_series
VLLM_SERIES: set[str] = _dashboard.VLLM_SERIES


def _load(name: str) -> Any:
    return yaml.safe_load((DASHBOARDS / name).read_text(encoding="utf-8"))


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in _load("alerts.yml")["groups"] for rule in group["rules"] if "alert" in rule]


def unknown_series(expr: str, exported: set[str]) -> set[str]:
    return set(_SERIES.findall(expr)) - exported


def counters_not_rated(expr: str) -> list[str]:
    """Counters (``*_total``) of ``expr`` read otherwise than as the first argument of rate/irate/increase."""
    bad = []
    for match in _SERIES.finditer(expr):
        if not match.group(0).endswith("_total"):
            continue
        before = expr[: match.start()].rstrip()
        if not re.search(rf"\b(?:{'|'.join(_RATE_FUNCTIONS)})\s*\($", before):
            bad.append(match.group(0))
    return bad


def test_alerts_parse_and_are_complete() -> None:
    document = _load("alerts.yml")
    assert [group["name"] for group in document["groups"]] == ["hybridkv"]
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    # The four the operator asked for (issue 37): breaker open, failed-key ratio, saves failing, hit ratio collapse.
    wanted = {
        "vllm:hybridkv_breaker_open",
        "vllm:hybridkv_load_failed_keys_total",
        "vllm:hybridkv_save_failed_keys_total",
        "vllm:hybridkv_lookup_hits_total",
    }
    named = {name for rule in rules for name in _SERIES.findall(rule["expr"])}
    assert wanted <= named, f"no alert on {sorted(wanted - named)}"
    for rule in rules:
        where = rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, where
        assert _DURATION.fullmatch(str(rule["for"])), f"{where}: `for: {rule['for']}` is no duration"
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), where
        assert {"summary", "description"} <= set(rule["annotations"]), where
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), f"{where}: brackets"
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert _DURATION.fullmatch(window), f"{where}: range [{window}]"


def test_every_alert_names_an_exported_series() -> None:
    exported = hybridkv_series() | VLLM_SERIES
    for rule in alert_rules():
        names = set(_SERIES.findall(rule["expr"]))
        assert names, f"{rule['alert']}: names no vllm: series"
        unknown = unknown_series(rule["expr"], exported)
        assert not unknown, f"{rule['alert']}: {sorted(unknown)} is not exported by the connector or vLLM"
        assert not counters_not_rated(rule["expr"]), (
            f"{rule['alert']}: counters {counters_not_rated(rule['expr'])} read without rate()/increase()"
        )


def test_the_check_catches_a_misnamed_series() -> None:
    """The checks above would fail on a typo'd name or a raw counter (guards the regexes themselves)."""
    exported = hybridkv_series() | VLLM_SERIES
    assert unknown_series("rate(vllm:hybridkv_load_failed_key_total[5m]) > 0", exported) == {
        "vllm:hybridkv_load_failed_key_total"
    }
    assert not unknown_series("rate(vllm:hybridkv_load_failed_keys_total[5m]) > 0", exported)
    assert counters_not_rated("vllm:hybridkv_lookups_total > 0") == ["vllm:hybridkv_lookups_total"]
    assert not counters_not_rated("rate(vllm:hybridkv_lookups_total[5m] offset 1h)")


def test_every_alert_links_an_existing_troubleshooting_section() -> None:
    anchors = anchors_of(TROUBLESHOOTING)
    for rule in alert_rules():
        text = " ".join(str(value) for value in rule["annotations"].values())
        links = _LINK.findall(text)
        assert links, f"{rule['alert']}: no annotation links docs/troubleshooting.md#SECTION"
        for anchor in links:
            assert anchor in anchors, f"{rule['alert']}: docs/troubleshooting.md has no heading #{anchor}"


@pytest.mark.parametrize("name", ["prometheus.yml", "alerts.yml"])
def test_files_are_referenced(name: str) -> None:
    """The troubleshooting page links both files, and the scrape config loads the rules beside it."""
    assert f"](../dashboards/{name})" in TROUBLESHOOTING.read_text(encoding="utf-8"), name


def test_scrape_config_reads_vllm_metrics() -> None:
    config = _load("prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (DASHBOARDS / rule_file).is_file(), f"prometheus.yml loads missing {rule_file}"
    assert "alerts.yml" in config["rule_files"]
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [target for static in job["static_configs"] for target in static["targets"]]
    assert targets, "no scrape target"
    for target in targets:
        host, _, port = target.rpartition(":")
        assert host in ("localhost", "127.0.0.1") and port.isdigit(), (
            f"example target {target} is not loopback"
        )
    for key in ("scrape_interval", "evaluation_interval"):
        assert _DURATION.fullmatch(config["global"][key]), key
