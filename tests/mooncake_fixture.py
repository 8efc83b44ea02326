"""A real ``mooncake_master`` on loopback for tests (shared by ``tests/store`` and ``tests/e2e``).

Mooncake clients open wildcard listeners that cannot be bound to 127.0.0.1, so Mooncake tests must run in a
private network namespace with only ``lo`` (``scripts/netns-run``). ``new_master`` checks that and fails
with a clear message instead of skipping.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

MASTER_BINARY = Path(sys.executable).parent / "mooncake_master"
# Per-call Mooncake RPC timeout for the whole test process (Mooncake reads it once per process).
RPC_TIMEOUT_MS = 1000


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def network_interfaces() -> list[str]:
    """The interfaces of *this process's* network namespace.

    Not ``/sys/class/net``: sysfs shows the namespace of whoever mounted it, and ``scripts/netns-run``
    (``unshare --net``) does not remount it, so it still lists the host's interfaces inside the private
    namespace. The kernel's interface index (netlink) and ``/proc/self/net/dev`` follow the process.
    """
    by_index = sorted(name for _index, name in socket.if_nameindex())
    with open("/proc/self/net/dev") as dev:
        by_proc = sorted(line.split(":", 1)[0].strip() for line in dev.readlines()[2:])
    assert by_index == by_proc, (
        f"interface lists disagree: if_nameindex {by_index}, /proc/self/net/dev {by_proc}"
    )
    return by_index


def assert_loopback_only_namespace() -> None:
    interfaces = network_interfaces()
    assert interfaces == ["lo"], (
        f"Mooncake tests must run in a private network namespace with only 'lo' (found {interfaces}): "
        f"Mooncake clients listen on 0.0.0.0. Run them with: scripts/netns-run .venv/bin/python -m pytest ..."
    )


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` child process on 127.0.0.1 that tests may kill, freeze and restart."""

    rpc_port: int
    metrics_port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def url(self, **params: object) -> str:
        query = {"segment": "64MiB", "local_buffer": "16MiB", "timeout_ms": RPC_TIMEOUT_MS, **params}
        return f"mooncake://{self.address}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "mooncake_master already running"
        log_file = open(self.log_path, "ab")  # noqa: SIM115 -- handed to the child, closed right after
        self.process = subprocess.Popen(
            [
                str(MASTER_BINARY),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                "--default_kv_lease_ttl=200ms",
                "--client_ttl=3",
                "--logtostderr",
                *self.extra_args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        log_file.close()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mooncake_master exited early; see {self.log_path}"
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(
            f"mooncake_master did not listen on {self.address} within 10 s; see {self.log_path}"
        )

    def kill(self) -> None:
        assert self.process is not None, "mooncake_master was never started"
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def freeze(self) -> None:
        assert self.process is not None, "mooncake_master was never started"
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None, "mooncake_master was never started"
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def new_master(tmp_path_factory: pytest.TempPathFactory) -> MooncakeMaster:
    assert_loopback_only_namespace()
    assert MASTER_BINARY.exists(), (
        f"mooncake_master not found at {MASTER_BINARY} (install the Mooncake wheel)"
    )
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    log_dir = tmp_path_factory.mktemp("mooncake")
    master = MooncakeMaster(rpc_port=_free_port(), metrics_port=_free_port(), log_path=log_dir / "master.log")
    master.start()
    return master


_new_master = new_master
