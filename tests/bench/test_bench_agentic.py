"""``hybridkv bench agentic``: the trace generator's shape, the replay's hit accounting against an independent
count, and the command end to end, on tiny workloads."""

from __future__ import annotations

import argparse
import itertools
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from hybridkv.cli import build_parser, main
from hybridkv.store import open_store
from hybridkv.store.base import Status, Store, StoreError, Value
from hybridkv_dev.bench.agentic import (
    BACKGROUND_TENANT,
    CONFIGURATIONS,
    STORE_CHOICES,
    AgenticTrace,
    AgenticWorkload,
    ReplayResult,
    RequestKind,
    StoreConfiguration,
    block_hash_chain,
    generate_trace,
    opened_store,
    replay_trace,
    run_agentic_bench,
    tenant_salt,
)

#: A few short sessions and a few one-offs: a replay takes a fraction of a second.
TINY = AgenticWorkload(num_sessions=6, median_turns=6, one_off_share=0.2, one_off_median_tokens=256)
ATTENTION_BYTES = 4096
STATE_BYTES = 8192


def _independent_hit_tokens(trace: AgenticTrace) -> list[int]:
    """Per request, the hits of a store that never evicts, from the token ids alone (no hashes, no keys): the
    longest whole-block prefix, at most the prompt less one token, that an earlier request of the same
    tenant ended its last whole block on (a Mamba state is saved only there)."""
    block = trace.workload.block_tokens
    saved: set[tuple[str, tuple[int, ...]]] = set()
    hits: list[int] = []
    for request in trace.requests:
        tokens = trace.prompt_tokens(request)
        cap = min(len(tokens) - 1, len(tokens) // block * block)
        hit = max(
            (b for b in range(block, cap + 1, block) if (request.tenant, tokens[:b]) in saved), default=0
        )
        hits.append(hit)
        full = len(tokens) // block * block
        if full:
            saved.add((request.tenant, tokens[:full]))
    return hits


def _replay(
    trace: AgenticTrace, configuration: StoreConfiguration, capacity: int, tmp_path: Path
) -> ReplayResult:
    quota = capacity // 5
    with opened_store(configuration, capacity, quota, tmp_path) as store:
        return replay_trace(
            trace,
            store,
            configuration=configuration.name,
            capacity_bytes=capacity,
            reference_quota_bytes=quota,
            attention_value_bytes=ATTENTION_BYTES,
            state_value_bytes=STATE_BYTES,
            sample_every=1,
        )


def test_trace_is_deterministic_from_the_seed() -> None:
    assert generate_trace(TINY, 7) == generate_trace(TINY, 7)
    assert generate_trace(TINY, 7).requests != generate_trace(TINY, 8).requests


def test_trace_has_the_configured_shape() -> None:
    workload = AgenticWorkload(num_sessions=200, median_turns=8, one_off_median_tokens=64)
    trace = generate_trace(workload, 1)
    shape = trace.shape()
    assert shape["num_sessions"] == 200
    assert 8 * 0.8 <= shape["turns_per_session_median"] <= 8 * 1.2
    assert abs(shape["subagent_session_share"] - workload.subagent_session_share) < 0.1
    assert abs(shape["one_off_share"] - workload.one_off_share) < 0.01
    assert shape["num_human_pauses"] < shape["num_tool_pauses"]
    assert shape["human_pause_median_s"] > 10 * shape["tool_pause_median_s"]
    times = [request.time_s for request in trace.requests]
    assert times == sorted(times) and [r.index for r in trace.requests] == list(range(len(trace.requests)))

    block = workload.block_tokens
    chain_to_requests: dict[int, list[int]] = {}
    for request in trace.requests:
        chain_to_requests.setdefault(request.chain, []).append(request.index)
        prompt = trace.prompt_tokens(request)
        assert len(prompt) == request.num_prompt_tokens
        assert list(request.block_hashes) == block_hash_chain(prompt, block, tenant_salt(request.tenant))
    for chain in trace.chains:
        requests = [trace.requests[i] for i in chain_to_requests[chain.chain]]
        assert {r.tenant for r in requests} == {chain.tenant} and {r.kind for r in requests} == {chain.kind}
        # every prompt extends the chain's previous prompt
        for previous, following in itertools.pairwise(requests):
            assert following.num_prompt_tokens > previous.num_prompt_tokens
            assert trace.prompt_tokens(following)[: previous.num_prompt_tokens] == trace.prompt_tokens(
                previous
            )
        if chain.kind is RequestKind.ONE_OFF:
            assert chain.tenant == BACKGROUND_TENANT and len(requests) == 1
        elif chain.kind is RequestKind.SUBAGENT:
            # a fork starts from its parent's prefix, after the parent's request that forked it
            assert chain.parent is not None
            parent = trace.chains[chain.parent]
            assert chain.tokens[: chain.num_parent_tokens] == parent.tokens[: chain.num_parent_tokens]
            forked_after = [
                trace.requests[i]
                for i in chain_to_requests[parent.chain]
                if trace.requests[i].num_prompt_tokens <= chain.num_parent_tokens
            ]
            assert forked_after and forked_after[-1].time_s < requests[0].time_s
        else:
            assert chain.tenant != BACKGROUND_TENANT
    # one-off prompts are never reused: no other request shares any of their blocks
    one_off_blocks = [
        (r.tenant, h) for r in trace.requests if r.kind is RequestKind.ONE_OFF for h in r.block_hashes
    ]
    assert len(one_off_blocks) == len(set(one_off_blocks))
    assert {r.tenant for r in trace.requests if r.kind is not RequestKind.ONE_OFF} == {
        "tenant-a",
        "tenant-b",
        "tenant-c",
    }


@pytest.mark.parametrize("configuration", [CONFIGURATIONS[0], CONFIGURATIONS[2]], ids=lambda c: c.name)
def test_replay_hits_equal_an_independent_count_above_the_working_set(
    configuration: StoreConfiguration, tmp_path: Path
) -> None:
    trace = generate_trace(TINY, 3)
    working_set = trace.working_set_bytes(ATTENTION_BYTES, STATE_BYTES)
    result = _replay(trace, configuration, 2 * working_set, tmp_path)  # 2x: room for the frames' headers
    expected = _independent_hit_tokens(trace)
    agentic = [i for i, r in enumerate(trace.requests) if r.tenant != BACKGROUND_TENANT]
    assert result.hit_tokens == sum(expected) == sum(trace.ideal_hit_tokens()) > 0
    assert result.agentic_hit_tokens == sum(expected[i] for i in agentic)
    assert result.prompt_tokens == sum(r.num_prompt_tokens for r in trace.requests)
    assert result.bytes_written == working_set
    assert set(result.tenant_to_bytes_evicted.values()) == {0}
    assert result.num_load_failures == result.num_put_failures == 0


def test_a_tight_capacity_drops_hits_and_a_quota_protects_the_agents(tmp_path: Path) -> None:
    trace = generate_trace(TINY, 3)
    capacity = int(0.1 * trace.working_set_bytes(ATTENTION_BYTES, STATE_BYTES))
    lru = _replay(trace, CONFIGURATIONS[0], capacity, tmp_path)
    assert 0 < lru.hit_tokens < sum(trace.ideal_hit_tokens())
    assert sum(lru.tenant_to_bytes_evicted.values()) > 0
    assert lru.agentic_bytes_evicted_over_quota > 0
    assert lru.num_over_quota_puts > 0 and lru.quota_tenant_peak_bytes > capacity // 5
    for configuration in (CONFIGURATIONS[1], CONFIGURATIONS[4]):  # lru+quotas, file-lru+quotas
        quotas = _replay(trace, configuration, capacity, tmp_path)
        assert quotas.agentic_bytes_evicted_over_quota == 0, configuration.name
        assert set(quotas.tenant_to_bytes_evicted_over_quota.values()) == {0}, configuration.name
        assert quotas.num_over_quota_puts == 0 and quotas.quota_tenant_peak_bytes <= capacity // 5
        background = quotas.store_tenants[BACKGROUND_TENANT]
        assert background["usage_bytes"] <= background["quota_bytes"] == capacity // 5
        assert background["num_quota_evicted"] > 0


class _EvictsAnAgentOnBackgroundPuts:
    """A store that, at every put of the background tenant, also drops one entry of another tenant: what a
    store breaking the quota contract would do. The bench must count exactly those bytes."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.num_dropped_bytes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        statuses = self._store.put(keys, values)
        if keys and f"/{BACKGROUND_TENANT}/" in keys[0]:
            victim = next((k for k in self._store.iter_keys("hkv1/tenant-")), None)
            if victim is not None:
                self._store.remove([victim])
                self.num_dropped_bytes += ATTENTION_BYTES if "/g0/" in victim else STATE_BYTES
        return statuses


@pytest.mark.parametrize("quota_is_tiny", [True, False], ids=["over-quota", "within-quota"])
def test_the_bench_counts_what_the_store_evicted_around_background_puts(quota_is_tiny: bool) -> None:
    trace = generate_trace(TINY, 3)
    store = _EvictsAnAgentOnBackgroundPuts(open_store(f"memory://agentic-{uuid.uuid4().hex}"))
    quota = 1 if quota_is_tiny else 1 << 40
    result = replay_trace(
        trace,
        cast(Store, store),
        reference_quota_bytes=quota,
        attention_value_bytes=ATTENTION_BYTES,
        state_value_bytes=STATE_BYTES,
    )
    counted = (
        result.tenant_to_bytes_evicted_over_quota
        if quota_is_tiny
        else result.tenant_to_bytes_evicted_within_quota
    )
    other = (
        result.tenant_to_bytes_evicted_within_quota
        if quota_is_tiny
        else result.tenant_to_bytes_evicted_over_quota
    )
    assert store.num_dropped_bytes > 0
    assert sum(counted.values()) == store.num_dropped_bytes
    assert set(other.values()) == {0} and counted[BACKGROUND_TENANT] == 0
    num_background_puts = sum(r.tenant == BACKGROUND_TENANT for r in trace.requests)
    assert result.num_over_quota_puts == (num_background_puts if quota_is_tiny else 0)


def test_a_configuration_the_store_refuses_is_reported_unavailable(tmp_path: Path) -> None:
    refused = StoreConfiguration(
        "lru+unknown-policy", "memory", background_quota=False, url_params="policy=arc"
    )
    with pytest.raises(StoreError, match="policy"), opened_store(refused, 1 << 20, 1 << 18, tmp_path):
        pass
    report = run_agentic_bench(
        TINY,
        num_rounds=1,
        configurations=(CONFIGURATIONS[0], refused),
        attention_value_bytes=ATTENTION_BYTES,
        state_value_bytes=STATE_BYTES,
        scratch_dir=str(tmp_path),
    )
    assert [row["configuration"] for row in report["rows"]] == ["lru"]
    [unavailable] = report["unavailable"]
    assert unavailable["configuration"] == "lru+unknown-policy" and "policy" in unavailable["error"]


def test_the_command_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agentic.json"
    argv = ["bench", "agentic", "--sessions", "4", "--median-turns", "5", "--rounds", "2", "--store", "both"]
    code = main([*argv, "--out", str(out), "--no-plot", "--scratch-dir", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "targets:" in printed and "evicted MiB by tenant" in printed
    report = json.loads(out.read_text())
    assert report["benchmark"] == "agentic" and report["num_rounds"] == 2 and report["baseline"] == "lru"
    assert [row["configuration"] for row in report["rows"]] == [c.name for c in CONFIGURATIONS]
    assert report["unavailable"] == []
    for row in report["rows"]:
        assert 0 <= row["hit_fraction_min"] <= row["hit_fraction"] <= row["hit_fraction_max"] <= 1
        assert row["num_rounds"] == 2 and row["written_mib"] > 0
        assert set(row["evicted_mib_by_tenant"]) == set(report["shape"]["tenants"])
    assert report["rows"][0]["points_vs_baseline"] is None
    assert [t["target"].split(":")[0] for t in report["targets"]] == [
        "lru+quotas",
        "lru+sessions",
        "file-lru",
        "file-lru+quotas",
        "file-lru+sessions",
        "lru+quotas",
        "file-lru+quotas",
    ]
    assert all(t["met"] for t in report["targets"] if "over its quota" in t["target"])
    assert "evicted by background puts" in printed
    for row in report["rows"]:
        assert set(row["evicted_by_over_quota_mib_by_tenant"]) == set(report["shape"]["tenants"])
        if row["configuration"].endswith("+quotas"):
            assert row["evicted_by_over_quota_max_mib"] == 0 and row["num_over_quota_puts"] == 0
    assert {"num_sessions", "turns_per_session_median", "subagent_session_share", "one_off_share"} <= set(
        report["shape"]
    )
    assert report["shape"]["num_sessions"] == 4
    assert set(report["windows"]) == {"num_requests", "ideal", *(c.name for c in CONFIGURATIONS)}
    assert all(len(runs) == 2 for runs in report["rounds"].values())
    assert [run["seed"] for run in report["rounds"]["lru"]] == [0, 1]


def test_the_command_writes_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "hits.png"
    argv = ["bench", "agentic", "--sessions", "2", "--median-turns", "3", "--rounds", "1"]
    assert main([*argv, "--out", str(tmp_path / "a.json"), "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subparsers.choices[name]
    return parser


def test_the_command_help_shows_the_bench_defaults() -> None:
    """The parser repeats a few of the bench's values (so that building it loads no tooling): they agree."""
    dest_to_action = {a.dest: a for a in _subparser(build_parser(), "bench", "agentic")._actions}
    assert tuple(dest_to_action["store"].choices or ()) == STORE_CHOICES
    defaults = AgenticWorkload()
    assert f"the workload's, {defaults.num_sessions})" in (dest_to_action["sessions"].help or "")
    assert f"the workload's, {defaults.median_turns:g})" in (dest_to_action["median_turns"].help or "")
