"""Fixtures for store tests: temporary store URLs and a real ``mooncake_master`` on loopback.

Mooncake clients open wildcard listeners that cannot be bound to 127.0.0.1, so Mooncake tests must run in a
private network namespace with only ``lo`` (``scripts/netns-run``). The fixture checks that and fails with
a clear message instead of skipping.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hybridkv.store import open_store
from hybridkv.store.framed import FramedStore
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.mooncake import new_master as _new_master


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master shared by the tests that do not disturb it."""
    master = _new_master(tmp_path_factory)
    yield master
    master.stop()


@pytest.fixture
def private_mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A master of the test's own, for tests that kill or freeze it."""
    master = _new_master(tmp_path_factory)
    yield master
    master.stop()


@pytest.fixture(scope="session")
def shared_mooncake_store(mooncake_master: MooncakeMaster) -> Iterator[FramedStore]:
    """One Mooncake client for the session (setup + close cost ~1 s each, too much per example)."""
    # A generous deadline: this client checks conformance, not the breaker (tests/store/test_mooncake.py
    # does, with tight deadlines). A 1 s deadline under a loaded 2-core box opened the breaker mid-example.
    store = open_store(mooncake_master.url(timeout_ms=10000))
    yield store
    store.close()


@pytest.fixture
def memory_url() -> str:
    return f"memory://test-{uuid.uuid4().hex}"


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/store?capacity=64MiB"
