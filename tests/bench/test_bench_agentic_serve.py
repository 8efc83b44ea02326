"""``hybridkv bench agentic-serve``: the serve trace (what the engines are sent) on its own, the command's
argument checks, and one CI-size run through real servers.

The CI-size run (one round: ~60 requests of 6 sessions, three servers and a ``mooncake_master``, about a
minute on an idle 2-core host) asserts outcomes only, never timings: every request of every configuration
succeeded, the hybridkv configurations got external hits, the sessions configuration's hints were taken
(entries retained, none refused), every configuration saw the same local hits (the local prefix cache sees the
same requests in the same order, whatever tier fills in the rest), and the report's rows and targets have
their shape. It does not assert that ``file-lru+sessions`` hits at least as much as ``file-lru``: at this
size the two differ by a few blocks either way by chance (the file store's LRU clock is the files' mtime,
touched at most once a second, and saves land asynchronously, so which block a lookup finds depends on
wall-clock timing); that comparison is the bench's, over interleaved rounds. ``none`` (no connector, the
floor) is left out of the CI run to keep it at three server starts.

Run the slow test with ``scripts/netns-run .venv/bin/python -m pytest tests/bench/test_bench_agentic_serve.py``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv.cli.exit_codes import EXIT_USAGE
from hybridkv_dev.bench.agentic import RequestKind
from hybridkv_dev.bench.agentic_serve import (
    BASELINE,
    CONFIGURATIONS,
    SESSIONS_CONFIGURATION,
    TABLE_COLUMNS,
    ServeSetup,
    bench_model,
    build_serve_trace,
    describe_report,
    request_body,
    run_agentic_serve_bench,
)

#: CI size: C = 0.8 x the trace's ~22 MiB working set, above Mooncake's 16 MiB smallest segment.
CI_SETUP = ServeSetup(num_sessions=6, max_requests=60, capacity_fraction=0.8)
#: Two hybridkv servers: the in-tree peer's server and master would double the test's time (its path runs in the
#: full bench; its scheduler half in ``test_bench_scheduler_peer``, its serving in bench serve's tests).
CI_CONFIGURATIONS = (BASELINE, SESSIONS_CONFIGURATION)


def test_the_serve_trace_fits_the_model_and_orders_each_session() -> None:
    setup = ServeSetup(num_sessions=6, max_requests=120, max_model_len=1024)
    trace = build_serve_trace(setup, 3, vocab_size=512)
    again = build_serve_trace(setup, 3, vocab_size=512)
    assert [r.prompt for r in trace.requests] == [r.prompt for r in again.requests], "not pure"
    requests = trace.requests
    assert len(requests) == 120 and trace.num_cut > 0, trace.shape()
    assert trace.num_trace_requests == len(requests) + trace.num_cut + trace.num_too_long
    assert all(len(r.prompt) <= setup.max_prompt_tokens for r in requests)
    assert all(3 <= t < 512 for r in requests for t in r.prompt)
    assert all(len(r.block_hashes) == len(r.prompt) // setup.block_tokens for r in requests)
    by_chain: dict[int, list[int]] = {}
    for r in requests:
        by_chain.setdefault(r.chain, []).append(r.index)
        assert all(i < r.index for i in r.after), r
        if r.kind is RequestKind.ONE_OFF:
            assert r.session_id is None and not r.session_end and not r.after
        else:
            assert r.session_id == f"{r.tenant}/chain-{r.chain}"
    for indices in by_chain.values():
        ends = [requests[i].session_end for i in indices]
        if requests[indices[0]].kind is RequestKind.ONE_OFF:
            assert ends == [False], ends
        else:
            assert ends == [False] * (len(indices) - 1) + [True], ends
        for earlier, later in itertools.pairwise(indices):
            assert earlier in requests[later].after, "a turn must wait for its session's previous turn"
            # a chain's prompts only grow: the shared prefix survives the vocabulary mapping
            prefix = requests[earlier].prompt
            assert requests[later].prompt[: len(prefix)] == prefix
    shape = trace.shape()
    assert 0 < shape["ideal_share"] < 1 and shape["working_set_blocks"] > 0


def test_request_bodies_carry_the_tenant_and_only_the_sessions_configuration_a_hint() -> None:
    setup = ServeSetup(num_sessions=3, max_requests=40)
    trace = build_serve_trace(setup, 0, vocab_size=512)
    turn = next(r for r in trace.requests if r.kind is RequestKind.TURN)
    for configuration in CONFIGURATIONS:
        body = request_body(turn, configuration, setup)
        assert body["prompt"] == list(turn.prompt) and body["cache_salt"] == f"salt:{turn.tenant}"
        assert body["temperature"] == 0 and body["max_tokens"] == setup.max_tokens
        assert ("kv_transfer_params" in body) is (configuration == SESSIONS_CONFIGURATION), configuration
    hint = request_body(turn, SESSIONS_CONFIGURATION, setup)["kv_transfer_params"]["hybridkv_session"]
    assert hint == {"id": turn.session_id, "ttl_s": setup.session_ttl_s, "end": turn.session_end}
    from hybridkv.connector.scheduler.sessions import parse_session_hint

    parsed, reason = parse_session_hint({"hybridkv_session": hint})
    assert reason is None and parsed is not None and parsed.session_id == turn.session_id


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "agentic-serve", "--configs", "lru"]) == EXIT_USAGE
    assert main(["bench", "agentic-serve", "--rounds", "0"]) == EXIT_USAGE
    assert main(["bench", "agentic-serve", "--sessions", "0"]) == EXIT_USAGE
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_a_ci_size_run_through_real_servers(tmp_path: Path) -> None:
    model = bench_model()
    report = run_agentic_serve_bench(
        model,
        CI_SETUP,
        tmp_path / "work",
        configurations=CI_CONFIGURATIONS,
        num_rounds=1,
        scratch_dir=str(tmp_path),
    )
    runs = {name: rs[0] for name, rs in report["runs"].items()}
    assert set(runs) == set(CI_CONFIGURATIONS)
    num_requests = report["shape"]["num_requests"]
    for name, run in runs.items():
        assert "error" not in run, f"{name}: {run.get('error')}"
        assert run["requests"] == num_requests and run["errors"] == 0, (name, run["error_samples"])
        assert run["vllm_prompt_tokens"] == run["prompt_tokens"], name
    for name in (BASELINE, SESSIONS_CONFIGURATION):
        assert runs[name]["external_hit_tokens"] > 0, f"{name}: no external hit"
        assert runs[name]["store_bytes_written"] > 0, name
        assert runs[name]["hybridkv"]["hybridkv_load_failed_keys"] == 0, name
    sessions = runs[SESSIONS_CONFIGURATION]["hybridkv"]
    assert sessions["hybridkv_session_retained_keys"] > 0 and sessions["hybridkv_session_hints_refused"] == 0
    assert runs[BASELINE]["hybridkv"]["hybridkv_session_retained_keys"] == 0
    local = {name: run["local_hit_tokens"] for name, run in runs.items()}
    assert len(set(local.values())) == 1, f"the local cache saw different requests: {local}"

    rows = {row["configuration"]: row for row in report["rows"]}
    assert list(rows) == list(CI_CONFIGURATIONS)
    for row in rows.values():
        assert set(TABLE_COLUMNS) <= set(row) and row["rounds"] == 1 and row["errors"] == 0
        assert 0 < row["store_share"] < 1
    assert rows[BASELINE]["points_vs_baseline"] is None
    assert rows[SESSIONS_CONFIGURATION]["points_vs_baseline"] is not None
    targets = report["targets"]
    assert targets[0]["target"].split(":")[0] == SESSIONS_CONFIGURATION, targets
    assert all(set(t) == {"target", "value", "limit", "met"} for t in targets)
    assert targets[-2]["value"] == 0 and targets[-2]["met"] and targets[-1]["met"], targets
    windows = report["windows"]
    assert {*CI_CONFIGURATIONS, "ideal"} <= set(windows)
    assert len(windows[BASELINE]) == len(windows["ideal"])
    assert report["capacity_bytes"][0] >= 16 << 20
    assert "store capacity" in describe_report(report)
