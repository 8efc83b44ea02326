"""A real ``mooncake_master`` on loopback for tests (shared by ``tests/store``, ``tests/e2e``, ``tests/serve``).

The master is ``hybridkv.devkit.mooncake.MooncakeMaster`` (the product's ``master_command`` argv on free
loopback ports). Mooncake clients open wildcard listeners that cannot be bound to 127.0.0.1, so Mooncake
tests must run in a private network namespace with only ``lo`` (``scripts/netns-run``). ``new_master``
checks that and fails with a clear message instead of skipping.
"""

from __future__ import annotations

import os

import pytest
from hybridkv.devkit.mooncake import MooncakeMaster
from hybridkv.devkit.net import network_interfaces

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


def new_master(tmp_path_factory: pytest.TempPathFactory) -> MooncakeMaster:
    assert_loopback_only_namespace()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    log_dir = tmp_path_factory.mktemp("mooncake")
    master = SuiteMaster(log_dir / "master.log", lease_ttl="200ms", client_ttl_s=3, start_timeout_s=10.0)
    master.start()
    return master
