"""A real ``mooncake_master`` on loopback for tests (shared by ``tests/store``, ``tests/e2e``,
``tests/serve``, ``tests/devkit``, ``tests/bench``, ``tests/multihost``).

The master is ``hybridkv_dev.devkit.mooncake.MooncakeMaster`` (the product's ``master_command`` argv on free
loopback ports). Mooncake clients open wildcard listeners that cannot be bound to 127.0.0.1, so Mooncake
tests must run in a private network namespace with only ``lo`` (``scripts/netns-run``). ``new_master``
checks that and fails with a clear message instead of skipping.
"""

from __future__ import annotations

import os

import pytest
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hybridkv_dev.devkit.net import network_interfaces

# Per-call Mooncake RPC timeout for the whole test process (Mooncake reads it once per process).
RPC_TIMEOUT_MS = 1000


def assert_loopback_only_namespace() -> None:
    interfaces = network_interfaces()
    assert interfaces == ["lo"], (
        f"Mooncake tests must run in a private network namespace with only 'lo' (found {interfaces}): "
        f"Mooncake clients listen on 0.0.0.0. Run them with: scripts/netns-run .venv/bin/python -m pytest ..."
    )


class SuiteMaster(MooncakeMaster):
    """A short lease (200 ms) and client TTL (3 s), URLs with the suite's RPC timeout."""

    def url(self, **params: object) -> str:
        return super().url(**{"timeout_ms": RPC_TIMEOUT_MS, **params})


def freeze_until_stopped(master: MooncakeMaster) -> None:
    """Freeze ``master`` (SIGSTOP) and return only once none of its threads can run until ``master.thaw()``.

    ``master.freeze()`` alone is not enough: kill(2) returns before the group stop is complete (each thread
    stops only when it next runs in the kernel), so under load a master thread can still answer a request
    sent after ``freeze()`` returned. On a loaded 2-core box most SIGSTOPs had threads still running right
    after kill(2), and a get after ``freeze()`` once answered ``OK``. ``waitpid(WUNTRACED)`` reports the
    child stopped only when the whole group stop is complete.
    """
    master.freeze()
    assert master.process is not None, "mooncake_master was never started"
    _pid, status = os.waitpid(master.process.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), (
        f"mooncake_master did not stop (wait status {status:#x}); see {master.log_path}"
    )


def new_master(tmp_path_factory: pytest.TempPathFactory) -> MooncakeMaster:
    assert_loopback_only_namespace()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    log_dir = tmp_path_factory.mktemp("mooncake")
    master = SuiteMaster(log_dir / "master.log", lease_ttl="200ms", client_ttl_s=3, start_timeout_s=10.0)
    master.start()
    return master
