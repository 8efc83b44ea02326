"""vLLM engines on two hosts sharing one Mooncake deployment that outlives them.

Host A (10.77.0.1) runs ``mooncake_master`` and a storage node (a 64 MiB segment); engines are pure clients
(``segment=0``) on host B (10.77.0.2) or A. Only ``lo`` and the veth pair exist (see ``support/hosts.py``).

- an engine on B saves and exits; a new engine process on B (started meanwhile, its request held until the
  first one exited) takes the prefix from the store at once, with identical greedy tokens;
- two engines on B send the same prompt at the same moment: both succeed, the master holds each key once
  (insert-if-absent), no save or load fails; an engine on A then hits B's entries with identical tokens.

Every engine exits 0 and its audit log replays without violations (``EngineRun.result``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cluster import Cluster, prompt

pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.vllm]

#: Keys per 300-token prompt on the tiny qwen3_next: 2 attention blocks + 1 GDN boundary state.
KEYS_PER_PROMPT = 3
#: Each test uses a namespace of its own: its first engine also writes the deployment's manifest (one key per
#: namespace and fingerprint, insert-if-absent, so concurrent engines write it once).
MANIFEST_KEYS = 1


def test_new_engine_process_hits_what_an_exited_engine_saved(cluster: Cluster, tmp_path: Path) -> None:
    tokens = prompt(41)
    keys_before = cluster.metric("master_key_count")
    first_run = cluster.start_engine(cluster.pair.b, "b-first", [{"prompt": tokens}], namespace="outlive")
    # The second engine process starts meanwhile; it sends its request only once the first one has exited.
    first_exited = str(tmp_path / "b-first-exited")
    second_run = cluster.start_engine(
        cluster.pair.b, "b-second", [{"prompt": tokens, "wait_for": first_exited}], namespace="outlive"
    )
    try:
        first = first_run.result()
        step = first["steps"][0]
        assert step["cached"] == 0
        assert step["worker"]["save_keys"] == KEYS_PER_PROMPT
        assert step["worker"].get("save_failed_keys", 0) == 0
        assert step["store"]["preferred_segment"] == "", (
            "an engine with segment=0 must let the master place puts"
        )
        assert cluster.metric("master_key_count") == keys_before + KEYS_PER_PROMPT + MANIFEST_KEYS, (
            "entries died with engine 1"
        )
    except BaseException:
        second_run.process.kill()
        second_run.process.wait(10)
        raise

    (tmp_path / "b-first-exited").write_text("")
    second = second_run.result()
    hit = second["steps"][0]
    assert hit["tokens"] == step["tokens"], "tokens differ after a cross-host hit in a new engine process"
    assert hit["cached"] == 256
    assert hit["sched"]["hit_tokens"] == 256 and hit["sched"].get("truncations", 0) == 0
    assert hit["worker"]["load_keys"] == KEYS_PER_PROMPT and hit["worker"].get("load_failed_keys", 0) == 0
    assert hit["worker"].get("save_keys", 0) == 0, "the hit prefix must not be written again"


def test_concurrent_engines_share_entries_and_the_other_host_hits_them(
    cluster: Cluster, tmp_path: Path
) -> None:
    tokens = prompt(42)
    keys_before = cluster.metric("master_key_count")
    go = str(tmp_path / "go")
    both = [
        cluster.start_engine(
            cluster.pair.b, f"b-twin{i}", [{"prompt": tokens, "wait_for": go}], namespace="twins"
        )
        for i in (1, 2)
    ]
    a_go = str(tmp_path / "a-go")
    on_a = cluster.start_engine(
        cluster.pair.a, "a-reader", [{"prompt": tokens, "wait_for": a_go}], namespace="twins"
    )
    # Both B engines were started together and wait for one signal: their requests race on every key.
    (tmp_path / "go").write_text("")
    twins = [engine.result() for engine in both]
    (tmp_path / "a-go").write_text("")
    reader = on_a.result()["steps"][0]

    steps = [twin["steps"][0] for twin in twins]
    assert steps[0]["tokens"] == steps[1]["tokens"]
    for step in steps:
        assert (
            step["worker"].get("save_failed_keys", 0) == 0 and step["worker"].get("load_failed_keys", 0) == 0
        )
        assert step["sched"].get("lookup_errors", 0) == 0
    saved = sum(step["worker"].get("save_keys", 0) for step in steps)
    skipped = sum(step["worker"].get("save_skipped_keys", 0) for step in steps)
    assert saved + skipped >= KEYS_PER_PROMPT
    assert cluster.metric("master_key_count") == keys_before + KEYS_PER_PROMPT + MANIFEST_KEYS, (
        "a key was stored twice"
    )

    assert reader["tokens"] == steps[0]["tokens"], "host A's hit on host B's entries changed the tokens"
    assert reader["cached"] == 256 and reader["worker"].get("load_failed_keys", 0) == 0
    print(f"twins saved {saved} keys, skipped {skipped} (already stored); host A hit 256 tokens")
