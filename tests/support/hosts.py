"""Two "hosts" for tests: two network namespaces joined by a veth pair, nothing else reachable.

Each host is an ``unshare --net`` child that only sleeps; its ``/proc/<pid>/ns/net`` is the namespace, and
``nsenter --net=...`` runs commands in it (``ip netns`` needs a ``/var/run/netns`` mount an unshared test
namespace does not have). Host A is 10.77.0.1/30 on ``veth-a``, host B 10.77.0.2/30 on ``veth-b``; both
have ``lo`` up. Mooncake's wildcard listeners therefore reach only ``lo`` and the pair.

Must run as root inside ``scripts/netns-run`` (the suite does): the pair is created from the test's own
private namespace, so nothing touches the machine's network.

Link faults: ``shape`` puts a token-bucket filter (rate + queue latency) on both ends, ``partition`` takes
the pair down (every packet lost) and ``heal`` undoes both. ``netem`` (delay, loss) is used when the
kernel has it (``has_netem``); many CI kernels do, some minimal ones do not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUBNET_PREFIX = "10.77.0"
#: Prefix for every child: SIGKILL it when the test process dies (no orphaned hosts or servers).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"]


@dataclass
class Host:
    name: str
    address: str
    device: str
    holder: subprocess.Popen[bytes]

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def argv(self, command: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net={self.netns}", *command]

    def run(self, command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command), check=check, capture_output=True, text=True, timeout=30)

    def popen(self, command: Sequence[str], log_path: Path, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``command`` in this host's namespace, stdout+stderr to ``log_path`` (setpriv and nsenter
        exec: the pid is the command's)."""
        with log_path.open("ab") as log:
            return subprocess.Popen(
                [*DIE_WITH_PARENT, *self.argv(command)], stdout=log, stderr=subprocess.STDOUT, **kwargs
            )


@dataclass
class HostPair:
    a: Host
    b: Host
    shaped: bool = field(default=False)

    @classmethod
    def create(cls) -> HostPair:
        hosts: list[Host] = []
        try:
            for name, octet in (("a", 1), ("b", 2)):
                holder = subprocess.Popen([*DIE_WITH_PARENT, "unshare", "--net", "sleep", "infinity"])
                hosts.append(Host(name, f"{SUBNET_PREFIX}.{octet}", f"veth-{name}", holder))
            _wait_for_netns(hosts)
            a, b = hosts
            _ip(["link", "add", a.device, "netns", str(a.holder.pid), "type", "veth", "peer", "name",
                 b.device, "netns", str(b.holder.pid)])  # fmt: skip
            for host in hosts:
                host.run(["ip", "link", "set", "lo", "up"])
                host.run(["ip", "addr", "add", f"{host.address}/30", "dev", host.device])
                host.run(["ip", "link", "set", host.device, "up"])
            return cls(a, b)
        except BaseException:
            for host in hosts:
                _end(host.holder)
            raise

    def close(self) -> None:
        for host in (self.a, self.b):
            _end(host.holder)  # the veth pair goes with the namespaces

    def shape(self, *, rate: str, latency_ms: int) -> None:
        """Token-bucket both ends: at most ``rate`` (e.g. ``8mbit``), packets queued up to ``latency_ms``."""
        for host in (self.a, self.b):
            host.run(["tc", "qdisc", "replace", "dev", host.device, "root", "tbf", "rate", rate,
                      "burst", "32kb", "latency", f"{latency_ms}ms"])  # fmt: skip
        self.shaped = True

    def netem(self, spec: Sequence[str]) -> None:
        """``tc netem`` on both ends, e.g. ``["delay", "50ms", "loss", "5%"]`` (needs ``has_netem``)."""
        for host in (self.a, self.b):
            host.run(["tc", "qdisc", "replace", "dev", host.device, "root", "netem", *spec])
        self.shaped = True

    def has_netem(self) -> bool:
        probe = self.a.run(["tc", "qdisc", "replace", "dev", self.a.device, "root", "netem", "delay", "0ms"],
                           check=False)  # fmt: skip
        if probe.returncode == 0:
            self.a.run(["tc", "qdisc", "del", "dev", self.a.device, "root"], check=False)
        return probe.returncode == 0

    def partition(self) -> None:
        for host in (self.a, self.b):
            host.run(["ip", "link", "set", host.device, "down"])

    def heal(self) -> None:
        for host in (self.a, self.b):
            if self.shaped:
                host.run(["tc", "qdisc", "del", "dev", host.device, "root"], check=False)
            host.run(["ip", "link", "set", host.device, "up"])
        self.shaped = False


def _ip(args: Sequence[str]) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _wait_for_netns(hosts: Sequence[Host]) -> None:
    """Until each holder has left our namespace (unshare is done) or died."""
    mine = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10.0
    for host in hosts:
        while True:
            assert host.holder.poll() is None, f"unshare --net for host {host.name} exited"
            try:
                if os.readlink(host.netns) != mine:
                    break
            except FileNotFoundError:
                pass
            assert time.monotonic() < deadline, f"host {host.name}: no network namespace after 10 s"
            time.sleep(0.02)


def _end(process: subprocess.Popen[Any], sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


end_process = _end
