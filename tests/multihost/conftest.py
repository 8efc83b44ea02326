"""Fixtures for the two-host tests: a fresh deployment (pair of namespaces, master, storage node) per module."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from support.cluster import Cluster, tiny_model
from support.hosts import HostPair
from support.mooncake import assert_loopback_only_namespace


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    assert_loopback_only_namespace()  # the pair is built from the suite's private namespace
    assert os.geteuid() == 0, "two-host tests need root in the test namespace (scripts/netns-run)"
    tmp = tmp_path_factory.mktemp("twohost")
    deployment = Cluster(HostPair.create(), tmp, tiny_model())
    try:
        deployment.start_master()
        deployment.start_node()
        yield deployment
    finally:
        deployment.stop()
