"""One size's Mooncake deployment for ``hybridkv bench scale --axis mooncake-entries``: a real ``mooncake_master``
on 127.0.0.1 (``hybridkv_dev.devkit.mooncake``, the product's argv) and one storage node (``python -m
hybridkv.store.mooncake_node``) mounting a segment sized so that N entries fill it to just under the master's
eviction high watermark; the master's metrics and the processes' RSS. The measurements are
:mod:`hybridkv_dev.bench.scale_mooncake`."""

from __future__ import annotations

import math
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hybridkv.store.frame import FIXED_HEADER_SIZE
from hybridkv.store.mooncake_node import MIN_SEGMENT_BYTES, READY_PREFIX, node_command

from hybridkv_dev.bench.scale import PUT_KEYS, key_of
from hybridkv_dev.devkit.mooncake import MooncakeMaster, running_master
from hybridkv_dev.devkit.net import LOOPBACK

__all__ = [
    "HIGH_WATERMARK",
    "MIN_VALUE_BYTES",
    "Deployment",
    "client_url",
    "frame_bytes_of",
    "master_metrics",
    "rss_mib_of",
    "running_deployment",
    "segment_bytes_for",
    "value_bytes_for",
]

MIN_VALUE_BYTES = 1024
#: ``mooncake_master --eviction_high_watermark_ratio`` the bench runs its masters with (Mooncake's default
#: is 0.9): eviction starts above this usage. Lower than the default because a pool's allocator cannot
#: place objects in all of it: a put taking a pool of 500 32 KiB objects from 0.85 to 0.95 was refused
#: (NO_SPACE) for some keys.
HIGH_WATERMARK = 0.8
#: A generous deadline per call: a loaded 2-core box must not open the backend's breaker mid-bench.
_TIMEOUT_MS = 10_000
_NODE_READY_TIMEOUT_S = 60.0


def value_bytes_for(smallest: int) -> int:
    """The value size of a run whose smallest store holds ``smallest`` keys: a power of two of at least
    ``MIN_VALUE_BYTES`` whose segment for ``smallest`` keys reaches Mooncake's minimum segment."""
    value = MIN_VALUE_BYTES
    while segment_bytes_for(smallest, frame_bytes_of(value)) < MIN_SEGMENT_BYTES:
        value *= 2
    return value


def frame_bytes_of(value_bytes: int) -> int:
    """One entry's object in Mooncake: the frame header (fixed part and key) and the value (the master
    allocates exactly that: 1,136 B per 1 KiB value, probed on 0.3.13)."""
    return FIXED_HEADER_SIZE + len(key_of(0).encode()) + value_bytes


def segment_bytes_for(entries: int, frame_bytes: int) -> int:
    """Room for ``entries`` frames and half a put batch under the high watermark: the timed put of
    ``PUT_KEYS`` takes the pool over it."""
    return math.ceil((entries + PUT_KEYS // 2) * frame_bytes / HIGH_WATERMARK)


def client_url(master: MooncakeMaster) -> str:
    """A pure client's URL (the engine side of the topology): no segment, the master places puts."""
    return (
        f"mooncake://{master.address}?segment=0&local_hostname={LOOPBACK}"
        f"&preferred_segment=none&timeout_ms={_TIMEOUT_MS}"
    )


def master_metrics(master: MooncakeMaster) -> dict[str, float]:
    """The master's ``master_*`` Prometheus gauges and counters (from its metrics port on 127.0.0.1)."""
    url = f"http://{LOOPBACK}:{master.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("master_") and value:
            out[name] = float(value.split()[0])
    return out


def rss_mib_of(pid: int | str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Deployment:
    """One size's master, storage node and bookkeeping (next key number, populate time)."""

    entries: int
    master: MooncakeMaster
    node: subprocess.Popen[str]
    segment_bytes: int
    frame_bytes: int
    value_bytes: int
    next_index: int = 0
    populate_s: float = 0.0
    #: the master's allocated and total bytes once populated
    allocated_bytes: float = 0.0
    capacity_bytes: float = 0.0
    #: the master's RSS with the node mounted and no key yet (MiB)
    master_rss_idle_mib: float = 0.0

    @property
    def url(self) -> str:
        return client_url(self.master)

    def newest(self, count: int) -> list[str]:
        return [key_of(i) for i in range(self.next_index - count, self.next_index)]

    def key_count(self) -> int:
        return int(master_metrics(self.master)["master_key_count"])


def _start_node(master: MooncakeMaster, segment_bytes: int, log: IO[str]) -> subprocess.Popen[str]:
    """The product's storage node mounting ``segment_bytes``; returns once it printed its ready line."""
    node = subprocess.Popen(
        node_command(master.address, LOOPBACK, segment_bytes=segment_bytes),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert node.stdout is not None
    deadline = time.monotonic() + _NODE_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = node.stdout.readline()
        if line.startswith(READY_PREFIX):
            return node
        if not line and node.poll() is not None:
            break
    node.kill()
    node.wait()
    raise RuntimeError(f"storage node on {master.address} did not get ready; see {log.name}")


def _stop_node(node: subprocess.Popen[str]) -> None:
    node.terminate()
    try:
        node.wait(timeout=15)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait(timeout=5)


@contextmanager
def running_deployment(
    root: Path, entries: int, value_bytes: int, eviction_ratio: float | None
) -> Iterator[Deployment]:
    """A started master and storage node for ``entries`` keys (stopped on exit)."""
    frame_bytes = frame_bytes_of(value_bytes)
    segment_bytes = max(MIN_SEGMENT_BYTES, segment_bytes_for(entries, frame_bytes))
    with ExitStack() as stack:
        master = stack.enter_context(
            running_master(
                root / f"master-{entries}.log",
                extra_args=[
                    f"--eviction_high_watermark_ratio={HIGH_WATERMARK}",
                    *([f"--eviction_ratio={eviction_ratio}"] if eviction_ratio is not None else []),
                ],
            )
        )
        log = stack.enter_context(open(root / f"node-{entries}.log", "w"))
        node = _start_node(master, segment_bytes, log)
        stack.callback(_stop_node, node)
        yield Deployment(entries, master, node, segment_bytes, frame_bytes, value_bytes)
