"""``hybridkv bench lookup`` and ``hybridkv bench ttft`` through the CLI entry point, tiny settings.

Both are developer benches: the development distribution adds their command module to the ``hybridkv``
command through the ``hybridkv.commands`` entry point group, which these tests check first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm]


@pytest.fixture(autouse=True)
def _ttft_cmds_registered() -> None:
    from hybridkv import cli

    assert "hybridkv_dev.cli.ttft_cmds" in cli._plugin_command_modules(), (
        "the development distribution is not installed (make setup installs dev/ beside hybridkv)"
    )


def _main(argv: list[str]) -> int:
    from hybridkv.cli import main

    return main(argv)


def test_bench_lookup_reports_ratio_per_store_and_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lookup.json"
    code = _main(
        [
            "bench",
            "lookup",
            "--prompt-tokens",
            "256,1024",
            "--iterations",
            "20",
            "--out",
            str(out),
            "--no-plot",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "lookup"
    rows = report["rows"]
    # 2 geometries x 2 default stores x 2 lengths
    assert len(rows) == 8
    assert {row["store"].split("://")[0] for row in rows} == {"memory", "file"}
    for row in rows:
        for key in ("bare_p50_us", "lifecycle_p50_us", "connector_p50_us", "connector_p99_us"):
            assert row[key] > 0, (key, row)
        assert row["connector_over_bare_p50"] == pytest.approx(row["connector_p50_us"] / row["bare_p50_us"])
        # every candidate key was stored, so the connector answered a hit up to the last full block
        assert row["num_keys"] > 0
        assert row["hit_tokens"] == (row["prompt_tokens"] - 1) // 128 * 128
    by_len = {(r["geometry"], r["store"].split("://")[0], r["prompt_tokens"]): r["num_keys"] for r in rows}
    assert by_len[("llama", "file", 1024)] > by_len[("llama", "file", 256)]
    assert by_len[("lfm2", "file", 1024)] > by_len[("llama", "file", 1024)]  # the state group adds keys
    printed = capsys.readouterr().out
    assert "connector_over_bare_p50" in printed and f"wrote {out}" in printed


def test_bench_lookup_rejects_bad_lengths(tmp_path: Path) -> None:
    assert _main(["bench", "lookup", "--prompt-tokens", "1k", "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_bench_ttft_tiny_external_hit_loads_bytes(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    code = _main(
        [
            "bench",
            "ttft",
            "--family",
            "llama,lfm2",
            "--size",
            "tiny",
            "--prompt-tokens",
            "300",
            "--rounds",
            "1",
            "--scratch-dir",
            str(tmp_path),
            "--out",
            str(out),
            "--no-plot",
        ]
    )
    assert code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["ttft.json"], (
        "the scratch dir under --scratch-dir is removed"
    )
    report = json.loads(out.read_text())
    assert report["benchmark"] == "ttft" and report["rounds"] == 1 and report["prompt_tokens"] == 300
    ours = {
        row["family"]: row for row in report["rows"] if row["connector"] == "HybridStoreConnector file://"
    }
    assert set(ours) == {"llama", "lfm2"}
    for family, row in ours.items():
        for key in ("cold_ms", "local_hit_ms", "external_hit_ms", "copy_floor_ms", "memcpy_gbps"):
            assert row[key] is not None and row[key] > 0, (family, key, row)
        assert row["external_over_local"] == pytest.approx(row["external_hit_ms"] / row["local_hit_ms"])
        assert row["cold_over_external"] == pytest.approx(row["cold_ms"] / row["external_hit_ms"])
        # the external hit really came from the store: 2 full 128-token blocks, bytes moved by the worker
        assert row["external_hit_tokens"] == 256, (family, row)
        assert row["loaded_bytes"] > 0 and row["loaded_keys"] > 0, (family, row)
        detail = report["details"][f"{family}/HybridStoreConnector file://"]
        assert detail["num_cached_tokens"]["cold"] == [0]
        assert detail["num_cached_tokens"]["local"] == [256]
    # the hybrid loads a state group too: more keys than full attention alone
    assert ours["lfm2"]["loaded_keys"] > 2
    baseline = [row for row in report["rows"] if row["connector"].startswith("ExampleConnector")]
    assert [row["family"] for row in baseline] == ["llama"]
    assert baseline[0]["external_hit_tokens"] > 0 and baseline[0]["loaded_bytes"] > 0
    assert any("lfm2" in line for line in report["not_measured"])
    # the hit profile: one per hybridkv engine, lookup and load timed from the audit log
    assert [(p["family"], p["connector"]) for p in report["profiles"]] == [
        ("llama", "HybridStoreConnector file://"),
        ("lfm2", "HybridStoreConnector file://"),
    ]
    for profile in report["profiles"]:
        assert profile["load_ms"] > 0 and profile["lookup_ms"] >= 0, profile
        assert profile["microbench_get_no_checksum_ms"] > 0 and profile["memcpy_ms"] > 0, profile
        # the worker's and the file store's own phases of the hit's load job
        row = ours[profile["family"]]
        assert profile["keys_read"] == row["loaded_keys"], (profile, row)
        for key in ("store_ms", "open_ms", "readv_ms", "verify_ms", "targets_commit_ms"):
            assert profile[key] > 0, (key, profile)
        # CPU time: some, and never more than the phase's wall time (a thread's CPU time is within its wall)
        for key in ("readv", "verify"):
            assert 0 < profile[f"{key}_cpu_ms"] <= profile[f"{key}_ms"] * 1.01 + 0.1, (key, profile)
        assert profile["queue_ms"] >= 0 and profile["report_ms"] >= 0, profile
        assert profile["store_ms"] <= profile["load_job_ms"], profile
    # the targets: per hybridkv row, its floor ratio against 2x, and no peer in this run: not met
    targets = {t["target"]: t for t in report["targets"]}
    for family, row in ours.items():
        floor = targets[f"{family}: HybridStoreConnector file://: overhead / copy floor"]
        assert floor["value"] == row["overhead_over_floor"] and floor["limit"] == "<= 2", floor
        assert floor["met"] == (row["overhead_over_floor"] is not None and row["overhead_over_floor"] <= 2.0)
        peer = targets[
            f"{family}: HybridStoreConnector file://: overhead / MooncakeStoreConnector (vLLM)'s overhead"
        ]
        assert peer["value"] is None and peer["met"] is False, peer


def test_overhead_is_the_median_of_per_round_differences_with_spread() -> None:
    from hybridkv_dev.bench.ttft import _row

    row = _row(
        "llama",
        "x",
        samples_s={
            "cold": [1.0, 1.0, 1.0],
            "local": [0.030, 0.040, 0.035],
            "external": [0.050, 0.045, 0.065],
        },
        ext_tokens=256,
        loaded_bytes=10_000_000,
        loaded_keys=10,
        memcpy_gbps=10.0,
    )
    # per round: 20, 5, 30 ms -> median 20 (not median(ext) - median(local) = 15)
    assert row["overhead_ms"] == pytest.approx(20.0)
    assert row["overhead_ms_spread"] == pytest.approx([5.0, 30.0])
    assert row["copy_floor_ms"] == pytest.approx(1.0)
    assert row["overhead_over_floor"] == pytest.approx(20.0)
    assert row["overhead_over_floor_spread"] == pytest.approx([5.0, 30.0])


def test_load_profile_reads_lookup_and_load_times_of_loaded_requests(tmp_path: Path) -> None:
    from hybridkv_dev.bench.ttft import _load_profile_from_audit

    records = [
        {"event": "lookup_started", "request_id": "a", "monotonic": 1.000},
        {"event": "miss_reported", "request_id": "a", "monotonic": 1.002},
        {"event": "lookup_started", "request_id": "b", "monotonic": 2.000},
        {"event": "hit_found", "request_id": "b", "monotonic": 2.004},
        {"event": "load_started", "request_id": "b", "monotonic": 2.010},
        {"event": "put_started", "request_id": "a", "wave": 0, "monotonic": 2.011},
        {"event": "load_verified", "request_id": "b", "monotonic": 2.030},
    ]
    audit = tmp_path / "audit.jsonl"
    audit.write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    [profile] = _load_profile_from_audit(audit)
    assert profile["lookup_ms"] == pytest.approx(4.0)
    assert profile["load_ms"] == pytest.approx(20.0)
    assert _load_profile_from_audit(tmp_path / "missing.jsonl") == []


@pytest.mark.slow
def test_bench_ttft_keyed_row_hits_like_the_plain_one(tmp_path: Path) -> None:
    """``--keyed``: a keyed-integrity file store beside the plain one; its external hit loads (and verifies
    under the key) the same blocks."""
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--family", "llama", "--size", "tiny", "--prompt-tokens", "300", "--rounds", "1"]
    argv += ["--no-baseline", "--keyed", "--scratch-dir", str(tmp_path), "--out", str(out), "--no-plot"]
    assert _main(argv) == 0
    rows = {row["connector"]: row for row in json.loads(out.read_text())["rows"]}
    plain, keyed = rows["HybridStoreConnector file://"], rows["HybridStoreConnector file:// keyed"]
    for row in (plain, keyed):
        assert row["external_hit_tokens"] == 256 and row["loaded_bytes"] > 0, row
    assert keyed["loaded_keys"] == plain["loaded_keys"], (keyed, plain)


def test_bench_ttft_mooncake_outside_a_private_namespace_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv_dev.devkit.net import loopback_only_namespace

    if loopback_only_namespace():
        pytest.skip("this process already runs in a loopback-only namespace (the Mooncake test run)")
    out = tmp_path / "ttft.json"
    assert _main(["bench", "ttft", "--mooncake", "--family", "llama", "--out", str(out)]) == 2
    assert "scripts/netns-run" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.mooncake
def test_bench_ttft_mooncake_rows_next_to_the_file_store(tmp_path: Path) -> None:
    """hybridkv on Mooncake and vLLM's MooncakeStoreConnector (own process) against the bench's own master:
    every engine really hit the external tier, and each overhead is divided by the peer's."""
    from support.mooncake import assert_loopback_only_namespace

    assert_loopback_only_namespace()
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--family", "llama", "--size", "tiny", "--prompt-tokens", "300"]
    code = _main([*argv, "--rounds", "1", "--mooncake", "--no-baseline", "--out", str(out), "--no-plot"])
    assert code == 0
    report = json.loads(out.read_text())
    rows = {row["connector"]: row for row in report["rows"]}
    assert list(rows) == [
        "HybridStoreConnector file://",
        "HybridStoreConnector mooncake://",
        "MooncakeStoreConnector (vLLM)",
    ], report["not_measured"]
    peer = rows["MooncakeStoreConnector (vLLM)"]
    for row in rows.values():
        assert row["external_hit_tokens"] == 256 and row["loaded_bytes"] > 0, row
        if peer["overhead_ms"] > 0:
            assert row["overhead_over_peer"] == pytest.approx(row["overhead_ms"] / peer["overhead_ms"])
        else:  # noise larger than the peer's hit: no ratio rather than a meaningless negative one
            assert row["overhead_over_peer"] is None
    assert report["details"]["llama/MooncakeStoreConnector (vLLM)"]["num_cached_tokens"]["local"] == [256]
    assert [p["connector"] for p in report["profiles"]] == [
        "HybridStoreConnector file://",
        "HybridStoreConnector mooncake://",
    ]


def test_bench_ttft_scratch_dir_must_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ttft.json"
    missing = tmp_path / "no-such-mount"
    assert _main(["bench", "ttft", "--scratch-dir", str(missing), "--out", str(out)]) == 2
    assert "--scratch-dir" in capsys.readouterr().err
    assert not out.exists()
