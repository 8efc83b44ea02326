"""A two-host Mooncake deployment for tests: master + storage node on host A, engines on A or B.

The processes are the ones ``hybridkv mooncake`` starts (``hybridkv.store.mooncake_node``'s argv helpers),
inside the namespaces of ``support.hosts.HostPair``. Engines run ``tests/multihost/engine_proc.py`` as new
processes (``python engine_proc.py SPEC.json``, ``tests/`` on their ``PYTHONPATH`` so the script imports
``support.engines``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.audit.replay import audit_file
from hybridkv.store.mooncake_node import (
    DEFAULT_METRICS_PORT,
    DEFAULT_RPC_PORT,
    READY_PREFIX,
    engine_store_url,
    master_command,
    node_command,
)

from support.hosts import Host, HostPair, end_process
from support.paths import TESTS_DIR, subprocess_env

MODELS_DIR = Path(os.environ.get("HYBRIDKV_TEST_MODELS", "/tmp/hybridkv-test-models"))
#: 2 full 128-token blocks + a tail: 256 tokens can come from the store, the tail is always computed.
PROMPT_LEN = 300
ENGINE_SCRIPT = TESTS_DIR / "multihost" / "engine_proc.py"
ENGINE_TIMEOUT_S = 300.0
#: Short TTLs keep fault tests quick: a dead node's keys vanish 3 s after its last heartbeat.
CLIENT_TTL_S = 3
LEASE_TTL = "500ms"


@dataclass
class EngineRun:
    name: str
    process: subprocess.Popen[bytes]
    out: Path
    log: Path
    audit_log: Path

    def result(self, timeout_s: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """Wait for a clean exit; the audit log must replay without violations."""
        try:
            rc = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise AssertionError(
                f"{self.name}: did not finish within {timeout_s} s; see {self.log}"
            ) from None
        text = self.log.read_text(errors="replace")
        assert rc == 0, f"{self.name}: exit status {rc}\n{text[-4000:]}"
        report = audit_file(self.audit_log)
        assert report.ok, f"{self.name}: audit violations {report.to_dict()['violations']}"
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


@dataclass
class Cluster:
    pair: HostPair
    tmp: Path
    model: Path
    segment: str = "64MiB"
    master: subprocess.Popen[bytes] | None = None
    node: subprocess.Popen[bytes] | None = None
    engines: list[EngineRun] = field(default_factory=list)

    @property
    def master_address(self) -> str:
        return f"{self.pair.a.address}:{DEFAULT_RPC_PORT}"

    def store_url(self, host: Host, timeout_ms: int = 2000) -> str:
        return (
            engine_store_url(self.master_address, host.address, timeout_ms=timeout_ms) + "&local_buffer=16MiB"
        )

    def start_master(self) -> None:
        assert self.master is None or self.master.poll() is not None, "master already running"
        command = master_command(self.pair.a.address, lease_ttl=LEASE_TTL, client_ttl_s=CLIENT_TTL_S)
        self.master = self.pair.a.popen(command, self.tmp / "master.log")
        _wait_until(lambda: self._metrics_text() is not None, 15.0, "mooncake_master metrics endpoint")

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(10)

    def start_node(self, segment: str | None = None) -> None:
        assert self.node is None or self.node.poll() is not None, "storage node already running"
        from hybridkv.store.params import parse_size

        log = self.tmp / f"node-{time.monotonic_ns()}.log"
        command = node_command(
            self.master_address, self.pair.a.address, segment_bytes=parse_size(segment or self.segment)
        )
        self.node = self.pair.a.popen(command, log, env=_env())
        node = self.node

        def ready() -> bool:
            assert node.poll() is None, f"storage node exited: {log.read_text()[-2000:]}"
            return READY_PREFIX in log.read_text()

        _wait_until(ready, 30.0, f"storage node ready line in {log}", fail_fast=True)
        _wait_until(
            lambda: self.metric("master_total_capacity_bytes") > 0, 15.0, "the node's segment mounted"
        )

    def wait_for_capacity(self, accept: Callable[[float], bool], timeout_s: float = 15.0) -> None:
        """Until the master's pool capacity (bytes of mounted segments) satisfies ``accept``."""
        _wait_until(lambda: accept(self.metric("master_total_capacity_bytes")), timeout_s, "pool capacity")

    def fill_pool(self) -> int:
        """Fill the pool with hard-pinned filler objects (never evicted) from a short-lived pure client on
        host A, until the master keeps refusing puts; returns the number stored.

        Smaller fillers follow larger ones, and refusals are retried for a while: the eviction the fill
        triggers frees unpinned entries in the background, which the next sizes take."""
        code = f"""
import time
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
store = MooncakeDistributedStore()
assert store.setup({self.pair.a.address!r}, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", {self.master_address!r}) == 0
config = ReplicateConfig()
config.with_hard_pin = True
count, code = 0, 0
for size in (1 << 20, 1 << 18, 1 << 16, 1 << 14):
    refusals = 0
    while refusals < 5:
        code = store.put(f"filler/{{count}}", b"f" * size, config)
        if code == 0:
            count, refusals = count + 1, 0
        else:
            refusals += 1
            time.sleep(0.2)
print("filled", count, code)
store.close()
"""
        run = self.pair.a.run([sys.executable, "-c", code], check=False)
        assert run.returncode == 0 and "filled" in run.stdout, run.stderr[-2000:]
        words = run.stdout.split()
        assert words[-1] == "-200", f"filler stopped with {words[-1]}, not NO_AVAILABLE_HANDLE"
        return int(words[-2])

    def kill_node(self) -> None:
        assert self.node is not None
        self.node.send_signal(signal.SIGKILL)
        self.node.wait(10)

    def stop(self) -> None:
        for engine in self.engines:
            if engine.process.poll() is None:
                engine.process.kill()
                engine.process.wait(10)
        for process in (self.node, self.master):
            if process is not None:
                end_process(process)
        self.pair.close()

    def metric(self, name: str) -> float:
        """A gauge of the master's Prometheus endpoint (``master_key_count``...), read from host A."""
        text = self._metrics_text()
        assert text is not None, "master metrics endpoint unreachable"
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in the master's metrics")

    def _metrics_text(self) -> str | None:
        code = (
            "import urllib.request,sys\n"
            f"sys.stdout.write(urllib.request.urlopen('http://{self.pair.a.address}:{DEFAULT_METRICS_PORT}"
            "/metrics',timeout=2).read().decode())"
        )
        run = self.pair.a.run([sys.executable, "-c", code], check=False)
        return run.stdout if run.returncode == 0 else None

    def start_engine(
        self, host: Host, name: str, steps: list[dict[str, Any]], *, namespace: str, timeout_ms: int = 2000
    ) -> EngineRun:
        spec = {
            "model": str(self.model),
            "store": self.store_url(host, timeout_ms),
            "namespace": namespace,
            "audit_log": str(self.tmp / f"{name}.audit.jsonl"),
            "out": str(self.tmp / f"{name}.json"),
            "steps": steps,
        }
        spec_path = self.tmp / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        log = self.tmp / f"{name}.log"
        # The script imports ``support``: ``tests/`` goes first on its PYTHONPATH.
        process = host.popen(
            [sys.executable, str(ENGINE_SCRIPT), str(spec_path)], log, env=subprocess_env(_env())
        )
        run = EngineRun(name, process, Path(spec["out"]), log, Path(spec["audit_log"]))
        self.engines.append(run)
        return run


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


def tiny_model() -> Path:
    from hybridkv.demo.tiny_models import build_tiny_model

    return build_tiny_model("qwen3_next", MODELS_DIR)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MC_TCP_BIND_ADDRESS", None)  # P2PHANDSHAKE advertises local_hostname
    return env


def _wait_until(check: Any, timeout_s: float, what: str, *, fail_fast: bool = False) -> None:
    """Poll ``check`` until true; its errors count as "not yet" unless ``fail_fast``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except (OSError, AssertionError):
            if fail_fast:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


__all__ = ["Cluster", "EngineRun"]
