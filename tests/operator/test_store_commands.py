"""Operator commands that tell the truth (issue 37, item 3).

Read-only commands never create a store; a file store remembers the capacity its engines run with, and
``store stats`` shows it; one default capacity; the deployments' manifests are not "keys not written by
hybridkv"; ``store clear`` clears one namespace, counts first on request, and clears a whole store only when
told ``--yes``; a closed pipe ends any command quietly; ``mooncake node`` refuses a bad host before printing
anything; a near-miss key or URL parameter gets a suggestion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hybridkv.cli import main
from hybridkv.connector.config import DEFAULT_CAPACITY
from hybridkv.store import Status, open_store
from hybridkv.store.params import byte_size
from hybridkv.store.url import DEFAULT_FILE_CAPACITY

#: Two deployments' block keys and a manifest, in namespaces ``chat`` and ``batch``.
CHAT_KEYS = [f"hkv1/chat/0123456789ab/g0/tp0/dcp0/{index:032x}" for index in range(3)]
BATCH_KEYS = [f"hkv1/batch/0123456789ab/g0/tp0/dcp0/{index:032x}" for index in range(2)]
MANIFEST = "hkv1/chat/0123456789ab/manifest"


def _engine_store(directory: Path, capacity: str = "64MiB") -> str:
    """A file store as an engine leaves it (opened by URL with ``capacity``), holding the keys above and
    one key of another tool; the URL an operator types for it (no ``capacity``)."""
    keys = [*CHAT_KEYS, *BATCH_KEYS, MANIFEST, "other/tool/key"]
    with open_store(f"file://{directory}?capacity={capacity}") as store:
        assert store.put(keys, [b"v" * 64] * len(keys)) == [Status.OK] * len(keys)
    return f"file://{directory}"


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code = main([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out else None


@pytest.mark.parametrize(
    "argv",
    [["store", "stats"], ["store", "ls"], ["store", "clear", "--yes"], ["store", "clear", "--dry-run"]],
    ids=["stats", "ls", "clear", "clear-dry-run"],
)
def test_a_mistyped_path_is_refused_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    typo = tmp_path / "hybridkv-typo"
    assert main([*argv, f"file://{typo}?capacity=1GiB"]) == 2
    captured = capsys.readouterr()
    assert "no file store at" in captured.err and "creates no store" in captured.err, captured.err
    assert captured.out == ""
    assert not typo.exists(), "a read-only command created the store it was asked about"


def test_one_default_capacity() -> None:
    assert DEFAULT_FILE_CAPACITY == byte_size(DEFAULT_CAPACITY) == 8 << 30


def test_stats_without_capacity_shows_what_the_engines_run_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv.store.file.capacity import CAPACITY_FILE  # here: the other tests run on code without it

    url = _engine_store(tmp_path / "store", capacity="64MiB")
    record = (tmp_path / "store" / CAPACITY_FILE).read_bytes()
    code, stats = _json(["store", "stats", url], capsys)
    assert code == 0 and stats["capacity_bytes"] == 64 << 20, stats
    assert "recorded by the engines" in stats["extra"]["capacity_source"]
    # The URL's own capacity wins, and an operator's command never rewrites the engines' record.
    code, stats = _json(["store", "stats", f"{url}?capacity=1MiB"], capsys)
    assert code == 0 and stats["capacity_bytes"] == 1 << 20 and stats["extra"]["capacity_source"] == "the URL"
    assert (tmp_path / "store" / CAPACITY_FILE).read_bytes() == record
    code, report = _json(["describe", "--store", url], capsys)
    assert code == 0 and report["usage"]["capacity_bytes"] == 64 << 20


def test_quotas_are_checked_against_the_engines_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/operations.md's ``store quota file:///dev/shm/hybridkv --set chat=40GiB`` on a 64 GiB store: the
    URL names no capacity, the engines run with 64 GiB."""
    url = _engine_store(tmp_path / "store", capacity="64GiB")
    code, report = _json(["store", "quota", url, "--set", "chat=40GiB"], capsys)
    assert code == 0 and report["tenants"]["chat"]["quota_bytes"] == 40 << 30, report


def test_manifests_are_not_foreign_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = _engine_store(tmp_path / "store")
    code, report = _json(["describe", "--store", url], capsys)
    assert code == 0
    assert report["usage"]["num_manifests"] == 1 and report["usage"]["num_other_keys"] == 1, report["usage"]
    assert main(["describe", "--store", url]) == 0
    assert "1 keys not written by hybridkv" in capsys.readouterr().out


def _keys(url: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    code, listing = _json(["store", "ls", url], capsys)
    assert code == 0
    return listing["keys"]


def test_clear_one_namespace_dry_run_and_the_whole_store_only_with_yes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _engine_store(tmp_path / "store")
    all_keys = _keys(url, capsys)
    assert len(all_keys) == 7

    assert main(["store", "clear", url]) == 2
    refused = capsys.readouterr().err
    assert "7 keys" in refused and "--yes" in refused and "--namespace" in refused, refused
    assert _keys(url, capsys) == all_keys, "a refused clear removed keys"

    code, report = _json(["store", "clear", url, "--namespace", "chat", "--dry-run"], capsys)
    assert code == 0 and report["num_removed"] == 4 and report["dry_run"], report
    assert _keys(url, capsys) == all_keys, "a dry run removed keys"

    assert main(["store", "clear", url, "--namespace", "chat"]) == 0
    assert "removed 4 keys under 'hkv1/chat/'" in capsys.readouterr().out
    assert _keys(url, capsys) == sorted([*BATCH_KEYS, "other/tool/key"])

    assert main(["store", "clear", url, "--namespace", "no/such"]) == 2
    assert "bad namespace" in capsys.readouterr().err
    assert main(["store", "clear", url, "--dry-run"]) == 0
    assert "would remove 3 keys" in capsys.readouterr().out
    assert main(["store", "clear", url, "--yes"]) == 0
    assert "removed 3 keys" in capsys.readouterr().out
    assert _keys(url, capsys) == []


def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path) -> None:
    """``hybridkv store ls URL | head -1``: far more output than a pipe holds, the reader gone after one
    line. No traceback, 141 as for a command a SIGPIPE stopped."""
    directory = tmp_path / "store"
    keys = [f"listing/{index:06d}/{'k' * 200}" for index in range(2000)]  # about 400 KiB of listing
    with open_store(f"file://{directory}?capacity=64MiB") as store:
        assert store.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
    command = (
        f"{sys.executable} -m hybridkv.cli store ls file://{directory} | head -1; echo rc=${{PIPESTATUS[0]}}"
    )
    done = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ),
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.splitlines() == [keys[0], "rc=141"], done.stdout[-500:]


def test_mooncake_node_refuses_a_wildcard_host_before_printing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["mooncake", "node", "--master", "127.0.0.1:50051", "--segment", "1GiB"]
    assert main([*argv, "--host", "0.0.0.0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", f"printed before refusing the host: {captured.out!r}"
    assert "bad --host '0.0.0.0'" in captured.err
    assert (
        main(["mooncake", "node", "--master", "nohostport", "--host", "10.0.0.5", "--segment", "1GiB"]) == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and "bad --master 'nohostport'" in captured.err


def test_a_near_miss_key_or_url_parameter_gets_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["describe", "--config", '{"store": "memory://x", "namspace": "chat"}']) == 2
    assert "did you mean 'namespace'?" in capsys.readouterr().err
    url = _engine_store(tmp_path / "store")
    assert main(["store", "stats", f"{url}?capacty=1GiB"]) == 2
    assert "did you mean 'capacity'?" in capsys.readouterr().err
    assert main(["describe", "--config", '{"stor": "memory://x", "lookup_budget": 5}']) == 2
    err = capsys.readouterr().err
    assert "did you mean 'lookup_budget_ms' for 'lookup_budget', 'store' for 'stor'?" in err, err
    # Nothing close: no guess.
    assert main(["describe", "--config", '{"zzzz": 1}']) == 2
    assert "did you mean" not in capsys.readouterr().err
