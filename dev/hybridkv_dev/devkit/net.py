"""Loopback networking for tooling: a free TCP port and the loopback-only-namespace check.

Mooncake clients open wildcard listeners (``0.0.0.0``) that cannot be bound to 127.0.0.1, so everything
that starts Mooncake processes on loopback (tests, benches, the delayed deployment) runs only inside a
private network namespace whose only interface is ``lo`` (``scripts/netns-run``, ``unshare --net``).
"""

from __future__ import annotations

import socket
from pathlib import Path

__all__ = ["LOOPBACK", "NETNS_HINT", "free_port", "loopback_only_namespace", "network_interfaces"]

LOOPBACK = "127.0.0.1"

#: What to tell someone who ran a Mooncake tool outside such a namespace.
NETNS_HINT = (
    "Mooncake clients listen on 0.0.0.0: run this inside a private network namespace with only 'lo' "
    "(scripts/netns-run COMMAND ...)"
)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` (127.0.0.1) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def network_interfaces() -> list[str]:
    """The interfaces of *this process's* network namespace, sorted.

    Not ``/sys/class/net``: sysfs shows the namespace of whoever mounted it, and ``scripts/netns-run``
    (``unshare --net``) does not remount it, so it still lists the host's interfaces inside the private
    namespace. The kernel's interface index (netlink) and ``/proc/self/net/dev`` follow the process; both are
    read, and ``RuntimeError`` says so when they disagree.
    """
    by_index = sorted(name for _index, name in socket.if_nameindex())
    dev = Path("/proc/self/net/dev")
    if dev.exists():
        by_proc = sorted(line.split(":", 1)[0].strip() for line in dev.read_text().splitlines()[2:])
        if by_index != by_proc:
            raise RuntimeError(
                f"interface lists disagree: if_nameindex {by_index}, /proc/self/net/dev {by_proc}"
            )
    return by_index


def loopback_only_namespace() -> bool:
    """Whether this process's network namespace has only ``lo`` (``scripts/netns-run``)."""
    return network_interfaces() == ["lo"]
