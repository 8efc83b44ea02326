"""``hybridkv bench scheduler`` with vLLM's ``MooncakeStoreConnector`` as the peer, small settings: its lookups
are served by its own worker code in a child process against a real ``mooncake_master`` (behind the delay
proxy), on the prefixes the bench planted under its keys. Outcomes only, never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]

PEER = "MooncakeStoreConnector"


@pytest.mark.slow
@pytest.mark.mooncake
def test_bench_scheduler_peer_rows_find_the_planted_prefixes(tmp_path: Path) -> None:
    from hybridkv.cli import main
    from hybridkv.connector.vllm_compat import vllm_release
    from support.mooncake import assert_loopback_only_namespace

    assert_loopback_only_namespace()
    out = tmp_path / "scheduler.json"
    argv = ["bench", "scheduler", "--requests", "4", "--max-tokens", "8192", "--rounds", "1", "--peer"]
    assert main([*argv, "--forward-ms", "0.5", "--idle-steps", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["store"]: row for row in report["rows"]}
    ours = rows["mooncake (master +2.5 ms each way)"]
    # vLLM 0.34 adds lookup prefetch: the peer's third mode.
    modes = ["sync", "async"] + (["async+prefetch"] if vllm_release() >= (0, 34) else [])
    peers = [rows[f"{PEER} {mode} (master +2.5 ms each way)"] for mode in modes]
    connectors = ["none", "hybridkv", "hybridkv"] + ["peer"] * len(modes)
    assert [r["connector"] for r in report["rows"]] == connectors
    assert sorted(report["peer"]["modes"]) == sorted(modes)
    assert report["peer"]["connector"] == PEER and report["peer"]["like_for_like_row"] == ours["store"]
    # hybridkv finds exactly what its full scan finds, on either store.
    for row in report["rows"][1:3]:
        assert row["hit_tokens"] == row["full_scan_hit_tokens"] > 0, row["store"]
    for row in peers:
        # The peer really looked up (its worker served one batch_is_exist per lookup) and found the prefixes
        # planted under its own keys: the same stored prefixes as hybridkv's, so the same hit tokens.
        assert row["planted_keys"] > 0 and row["hit_tokens"] == ours["full_scan_hit_tokens"] > 0, row["store"]
        assert row["lookups_per_s"] > 0 and row["round_trips_max"] == 1 and row["keys_max"] > 0
        (run,) = report["rounds"][row["store"]]
        assert run["peer_lookups"] >= 2 and run["peer_exists_max_ms"] <= run["peer_lookup_max_ms"]
        # The split: the connector's own calls and vLLM's part, busy and idle steps.
        assert row["connector_p99_ms"] > 0 and row["busy_connector_p99_ms"] <= row["busy_schedule_p99_ms"]
        assert row["num_idle_steps"] >= 8 and "idle_p99_ratio" in row
    # The targets: hybridkv's own scheduler-thread time against each peer mode's, on the same store.
    targets = {t["target"]: t for t in report["targets"]}
    for mode, limit in (("sync", 0.25), ("async", 1.0)):
        target = targets[f"{ours['store']}: connector scheduler-thread p99 / {PEER} {mode}'s"]
        value = ours[f"connector_p99_over_peer_{mode}"]
        assert target == {
            "target": target["target"],
            "value": value,
            "limit": f"<= {limit:g}",
            "met": value <= limit,
        }
    # The prefetch mode is compared too, but has no target: the targets table is the same on every release.
    if "async+prefetch" in modes:
        assert ours["connector_p99_over_peer_async+prefetch"] > 0
        assert not any("prefetch" in t["target"] for t in report["targets"])
    for row in report["rows"][1:3]:
        assert targets[f"{row['store']}: idle-step schedule() p99 / no connector"]["limit"] == "<= 1.5"
        assert targets[f"{row['store']}: hit tokens / full scan's"]["met"] is True
    assert not any(t["target"].startswith(PEER) for t in report["targets"])


def test_bench_scheduler_peer_outside_the_namespace_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridkv.cli import main
    from hybridkv_dev.bench import scheduler_peer

    # The suite itself runs inside the private namespace: stand for a shell outside it.
    monkeypatch.setattr(scheduler_peer, "loopback_only_namespace", lambda: False)
    out = tmp_path / "scheduler.json"
    assert main(["bench", "scheduler", "--peer", "--requests", "1", "--out", str(out)]) == 2
    assert f"error: --peer ({PEER})" in capsys.readouterr().err
    assert not out.exists()
