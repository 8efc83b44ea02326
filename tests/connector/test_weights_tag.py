"""A tag shared between engines names the weights they hold, never a local count of resets.

vLLM resets the connector on weight updates and on much else (``pause_generation(clear_cache=True)``,
``sleep``, ``release_kv_cache_memory``, after its own local reset failed), and a restarted replica starts
counting again. So after a reset the keys carry the name the operator's ``weights_version_file`` gives the
weights this engine holds (an unchanged name keeps the keys), or a nonce private to this engine.

The scenario of issue 34, item 1, at the scheduler halves: replica A's weight update fails (A stays on W0)
but vLLM resets A's connector anyway; replica B updates to W1 and resets. With a count, both were
``run7+reset1``: A saved W0's KV where B, on W1, loaded it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridkv.connector.worker.side import WorkerSide
from hybridkv.lifecycle.sink import MemoryAuditSink
from support.scheduler import make_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]


def _side(objs: dict[str, Any], **extra: Any) -> Any:
    """A fresh scheduler half (another replica, or a restart) with ``extra`` in its connector config."""
    saved = dict(objs["extra"])
    objs["extra"].update(extra)
    try:
        side = make_scheduler(objs["vc"]).connector.scheduler_side
    finally:
        objs["extra"].clear()
        objs["extra"].update(saved)
    side.machine.sink = MemoryAuditSink()
    return side


def _reset(side: Any) -> None:
    assert side.reset_cache() is True and side.wait_maintenance(10)


def _rotated(side: Any) -> list[dict[str, Any]]:
    return [r for r in side.machine.sink.records if r["event"] == "weights_rotated"]


def test_a_failed_update_and_a_real_one_never_share_keys(objs: dict[str, Any]) -> None:
    """Both replicas declare ``weights_version: run7``; each is reset once (A's update failed, B's
    succeeded). Nothing tells the connector what either holds now: their keys must differ."""
    side_a = _side(objs, weights_version="run7")
    side_b = _side(objs, weights_version="run7")
    assert side_a.scheme.fingerprint == side_b.scheme.fingerprint  # same checkpoint, same declared name
    _reset(side_a)  # vLLM's reset after A's failed update: A still holds W0
    _reset(side_b)  # B updated to W1, then reset
    assert side_a.scheme.fingerprint != side_b.scheme.fingerprint, (
        f"A (on W0) and B (on W1) share keys {side_a.scheme.weights_tag!r}: B loads W0's KV"
    )
    for side in (side_a, side_b):
        assert "+reset" not in side.scheme.weights_tag
        (record,) = _rotated(side)
        assert record["detail"]["weights_source"] == "private"


def test_files_naming_the_weights_share_exactly_what_is_the_same(
    objs: dict[str, Any], tmp_path: Path
) -> None:
    """With a ``weights_version_file`` per replica, written after that replica's update succeeded: A's
    failed update leaves A's file on W0, B's and C's name W1. B and C share, A shares with neither, and
    A keeps the keys it had (an unchanged name: its weights did not change)."""
    files = {name: tmp_path / f"{name}.weights" for name in "abc"}
    sides = {
        name: _side(objs, weights_version="W0", weights_version_file=str(path))
        for name, path in files.items()
    }
    start = sides["a"].scheme.fingerprint
    files["a"].write_text("W0\n")
    files["b"].write_text("W1\n")
    files["c"].write_text("W1\n")
    _reset(sides["b"])
    _reset(sides["a"])  # one reset each, in another order than B's: no count to line up
    _reset(sides["c"])
    _reset(sides["c"])  # and C's second reset (a pause, no update): its name is unchanged
    fingerprints = {name: side.scheme.fingerprint for name, side in sides.items()}
    assert fingerprints["b"] == fingerprints["c"], "replicas on the same named weights stopped sharing"
    assert fingerprints["a"] != fingerprints["b"], "a replica on W0 shares keys with replicas on W1"
    assert fingerprints["a"] == start, "a reset without a weight change moved the keys"
    assert sides["b"].scheme.weights_tag == "W1"
    reasons = [r["detail"]["reason"] for r in _rotated(sides["c"])]
    assert reasons == ["named by weights_version_file", "unchanged"]


def test_a_restart_holds_its_checkpoint_whatever_the_file_says(objs: dict[str, Any], tmp_path: Path) -> None:
    """The file is read at resets only: a restarted engine holds its checkpoint's weights, so it starts on
    the checkpoint's keys (with ``weights_version``), not on the name its previous life wrote."""
    path = tmp_path / "weights"
    path.write_text("W5\n")
    before = _side(objs, weights_version="W0", weights_version_file=str(path))
    _reset(before)
    assert before.scheme.weights_tag == "W5"
    restarted = _side(objs, weights_version="W0", weights_version_file=str(path))
    assert restarted.scheme.weights_tag == "W0"
    assert restarted.scheme.fingerprint != before.scheme.fingerprint


@pytest.mark.parametrize("content", [None, "", "v1/step 7\n", "\xff"])
def test_an_unreadable_name_makes_the_keys_private(
    objs: dict[str, Any], tmp_path: Path, content: str | None
) -> None:
    """Missing, empty, not a valid name, not UTF-8: the engine cannot know its weights, so its keys are
    private to it (a fresh nonce at every such reset), never shared."""
    path = tmp_path / "weights"
    if content is not None:
        path.write_bytes(content.encode("latin-1"))
    side_a = _side(objs, weights_version="W0", weights_version_file=str(path))
    side_b = _side(objs, weights_version="W0", weights_version_file=str(path))
    _reset(side_a)
    _reset(side_b)
    first = side_a.scheme.fingerprint
    assert first != side_b.scheme.fingerprint
    assert side_a.scheme.weights_tag.startswith("private-")
    _reset(side_a)
    assert side_a.scheme.fingerprint != first, "two unknown weights in a row shared one tag"
    (record, _) = _rotated(side_a)
    assert record["detail"]["weights_source"] == "private"
    assert "weights_version_file" in record["detail"]["reason"]


def test_the_worker_geometry_shows_the_fingerprint_the_keys_use(objs: dict[str, Any]) -> None:
    """The worker's geometry log line spreads ``geo.describe()``: with ``weights_version`` it must name the
    scheduler's (tagged) fingerprint, not the checkpoint's."""
    objs["extra"]["weights_version"] = "run7"
    sched = make_scheduler(objs["vc"])
    side = sched.connector.scheduler_side
    worker = WorkerSide(objs["vc"], sched.kv_cache_config, side.cfg)
    try:
        assert worker.geo.describe()["fingerprint"] == side.geo.describe()["fingerprint"]
        assert worker.geo.scheme == side.scheme
    finally:
        worker.shutdown()
