"""Samples of a settled engine: the server's processes, the connector's gauges, the store's files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.soak.plan import CONNECTOR_GAUGES, HELD_GAUGES
from hybridkv_dev.devkit.openai_server import (
    metric,
    metrics_samples,
    openai_client,
)

# --- samples ------------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it (from each process's parent in ``/proc/*/stat``)."""
    pid_to_parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        pid_to_parent[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree.extend(child for child, of in sorted(pid_to_parent.items()) if of == parent)
    return tree


def _process_sample(pid: int) -> dict[str, Any] | None:
    """One process's name, resident bytes, threads and open descriptors; None when it ended meanwhile."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_threads = len(os.listdir(f"/proc/{pid}/task"))
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "pid": pid,
        "name": fields.get("Name", "?").strip(),
        "rss_bytes": rss_kib << 10,
        "num_threads": num_threads,
        "num_fds": num_fds,
    }


def process_tree_sample(pid: int) -> dict[str, Any]:
    """The process tree of ``pid`` (``process_tree``): per process and summed over it, resident bytes,
    threads and open file descriptors, and the number of processes."""
    processes = [p for p in (_process_sample(p) for p in process_tree(pid)) if p is not None]
    return {
        "rss_mib": sum(p["rss_bytes"] for p in processes) / (1 << 20),
        "num_threads": sum(p["num_threads"] for p in processes),
        "num_fds": sum(p["num_fds"] for p in processes),
        "num_processes": len(processes),
        "processes": processes,
    }


def _files_under(directory: Path) -> list[int]:
    """Sizes of the regular files anywhere under ``directory`` (none when it does not exist)."""
    sizes: list[int] = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            try:
                sizes.append(os.stat(os.path.join(root, name)).st_size)
            except OSError:  # evicted or published meanwhile
                continue
    return sizes


def store_files_sample(store_dir: Path) -> dict[str, Any]:
    """The file store's files (``hybridkv.store.file.layout``): published frames under ``objects/`` (count,
    bytes, the median size), temp files under ``tmp/``, recycled spares under ``spare/`` (count, bytes);
    ``store_bytes`` is objects and spares together (what ``capacity`` bounds)."""
    objects = _files_under(store_dir / "objects")
    spares = _files_under(store_dir / "spare")
    return {
        "num_store_files": len(objects),
        "object_bytes": sum(objects),
        "median_object_bytes": sorted(objects)[len(objects) // 2] if objects else None,
        "num_tmp_files": len(_files_under(store_dir / "tmp")),
        "num_spare_files": len(spares),
        "spare_bytes": sum(spares),
        "store_bytes": sum(objects) + sum(spares),
    }


def connector_sample(base_url: str) -> dict[str, float]:
    """The connector's gauges (``CONNECTOR_GAUGES``) and vLLM's requests running plus waiting, from
    ``/metrics``. Gauges refresh at engine steps (``settle`` makes one)."""
    samples = metrics_samples(base_url)
    out = {key: metric(samples, name) for key, name in CONNECTOR_GAUGES.items()}
    out["vllm_requests_in_engine"] = metric(samples, "vllm:num_requests_running") + metric(
        samples, "vllm:num_requests_waiting"
    )
    return out


def take_sample(
    num_requests: int, server_pid: int, base_url: str, store_dir: Path | None, *, started: float
) -> dict[str, Any]:
    """One sample of every series after ``num_requests`` requests: the server's process tree, the
    connector's gauges, the store's files (``store_dir`` None: none), seconds since ``started``
    (``time.monotonic``)."""
    sample: dict[str, Any] = {"requests": num_requests, "wall_s": time.monotonic() - started}
    sample.update(process_tree_sample(server_pid))
    sample.update(connector_sample(base_url))
    if store_dir is not None:
        sample.update(store_files_sample(store_dir))
    return sample


def tick(base_url: str) -> bool:
    """One greedy one-token completion of a prompt shorter than a block (nothing to save or load): the engine
    steps, and the stats of that step refresh every gauge. False when it failed."""
    try:
        openai_client(base_url, 120.0).completions.create(
            model="tiny", prompt="ping", max_tokens=1, temperature=0
        )
    except Exception:  # noqa: BLE001 -- a failed tick is reported by the caller, never raised
        return False
    return True


def settle(base_url: str, *, max_ticks: int = 8, pause_s: float = 0.3) -> dict[str, Any]:
    """Let the engine come to rest and refresh its gauges: wait ``pause_s`` (late store calls finish within
    ``late_ms``), ``tick``, read the gauges; again while a gauge of ``HELD_GAUGES`` is above 0, at most
    ``max_ticks`` times. Returns the number of ticks, of failed ticks and the last gauges read."""
    num_ticks = num_failed = 0
    gauges: dict[str, float] = {}
    while num_ticks < max_ticks:
        time.sleep(pause_s)
        num_ticks += 1
        num_failed += not tick(base_url)
        gauges = connector_sample(base_url)
        if all(gauges[key] == 0 for key in HELD_GAUGES) and gauges["vllm_requests_in_engine"] == 0:
            break
    return {"num_ticks": num_ticks, "num_failed_ticks": num_failed, "gauges": gauges}
