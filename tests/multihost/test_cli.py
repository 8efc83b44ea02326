"""``hybridkv mooncake up`` on host A serves an engine-side client on host B; bad input fails at start."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support.hosts import HostPair
from support.mooncake import assert_loopback_only_namespace

pytestmark = pytest.mark.mooncake

CLI = [sys.executable, "-m", "hybridkv.cli"]


@pytest.fixture
def pair() -> Iterator[HostPair]:
    assert_loopback_only_namespace()
    hosts = HostPair.create()
    yield hosts
    hosts.close()


def test_up_prints_the_url_engines_on_another_host_use(pair: HostPair) -> None:
    up = subprocess.Popen(
        pair.a.argv([*CLI, "mooncake", "up", "--host", pair.a.address, "--segment", "32MiB"]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("storage node 10.77.0.1:") and "32MiB" in lines[0], lines
        url_line = lines[1]
        assert url_line.startswith("store URL for engines: mooncake://10.77.0.1:50051?segment=0&"), lines
        url = url_line.split(": ", 1)[1].strip().replace("ENGINE_HOST", pair.b.address)
        client = f"""
from hybridkv.store import open_store
store = open_store({url!r})
assert [s.value for s in store.put(["cli/k"], [b"v" * 4096])] == ["ok"]
destination = bytearray(4096)
assert [s.value for s in store.get_into(["cli/k"], [destination])] == ["ok"] and destination == b"v" * 4096
store.close()
print("client ok")
"""
        run = pair.b.run([sys.executable, "-c", client], check=False)
        assert "client ok" in run.stdout, run.stderr[-3000:]
    finally:
        up.send_signal(signal.SIGTERM)
        rc = up.wait(30)
    assert rc == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "--host", "0.0.0.0", "--segment", "1GiB"], "bad host '0.0.0.0'"),
        (["up", "--host", "10.77.0.1", "--segment", "1MiB"], "bad --segment '1MiB'"),
        (
            ["node", "--master", "10.77.0.1:50051", "--host", "10.77.0.1", "--segment", "4 parsecs"],
            "--segment",
        ),
    ],
)
def test_bad_deployment_input_is_refused_with_the_culprit_named(args: list[str], message: str) -> None:
    run = subprocess.run([*CLI, "mooncake", *args], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, (run.returncode, run.stderr)
