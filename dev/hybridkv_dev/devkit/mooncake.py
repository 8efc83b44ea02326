"""A ``mooncake_master`` child on 127.0.0.1 for tests and benches: start, kill, freeze, thaw, stop.

The argv is the product's (``hybridkv.store.mooncake_node.master_command``, what ``hybridkv mooncake
master`` runs), bound to loopback on free ports; this module only adds the child-process handling tooling
needs. Mooncake clients listen on ``0.0.0.0``, so callers check ``hybridkv_dev.devkit.net.loopback_only_namespace``
first (``running_master`` does).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hybridkv.store.mooncake_node import DEFAULT_CLIENT_TTL_S, DEFAULT_LEASE_TTL, master_command

from hybridkv_dev.devkit.net import LOOPBACK, NETNS_HINT, free_port, loopback_only_namespace

__all__ = ["MooncakeMaster", "running_master"]


@dataclass
class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 (RPC and metrics on free ports); its log goes to ``log_path``."""

    log_path: Path
    lease_ttl: str = DEFAULT_LEASE_TTL
    client_ttl_s: int = DEFAULT_CLIENT_TTL_S
    extra_args: Sequence[str] = ()
    start_timeout_s: float = 15.0
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    def url(self, **params: object) -> str:
        """A ``mooncake://`` URL on this master; ``params`` add to / override segment 64MiB, local_buffer 16MiB."""
        query: dict[str, object] = {"segment": "64MiB", "local_buffer": "16MiB", **params}
        return f"mooncake://{self.address}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def command(self) -> list[str]:
        return master_command(
            LOOPBACK,
            port=self.rpc_port,
            metrics_port=self.metrics_port,
            lease_ttl=self.lease_ttl,
            client_ttl_s=self.client_ttl_s,
            extra_args=self.extra_args,
        )

    def start(self) -> None:
        """Start the child and wait until its RPC port listens; ``RuntimeError`` (naming the log) if it
        exits or does not listen within ``start_timeout_s``. Restarts a master that was killed."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("mooncake_master already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited at start; see {self.log_path}")
            try:
                with socket.create_connection((LOOPBACK, self.rpc_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"mooncake_master did not listen on {self.address} within {self.start_timeout_s} s; "
            f"see {self.log_path}"
        )

    def _running(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("mooncake_master was never started")
        return self.process

    def kill(self) -> None:
        process = self._running()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def freeze(self) -> None:
        self._running().send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._running().send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGCONT (a frozen master cannot exit), SIGTERM, then SIGKILL after 5 s; a no-op when not running."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


@contextmanager
def running_master(log_path: Path, **options: object) -> Iterator[MooncakeMaster]:
    """A started ``MooncakeMaster(log_path, **options)`` for the block; stopped on exit. ``RuntimeError``
    outside a loopback-only network namespace."""
    if not loopback_only_namespace():
        raise RuntimeError(NETNS_HINT)
    master = MooncakeMaster(log_path, **options)  # type: ignore[arg-type]
    master.start()
    try:
        yield master
    finally:
        master.stop()
