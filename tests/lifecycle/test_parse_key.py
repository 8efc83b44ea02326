"""``parse_block_key`` is the inverse of ``KeyScheme.key`` (the CLI's store listings read keys through it)."""

from __future__ import annotations

from hybridkv.lifecycle import GroupSpec, KeyScheme
from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import BlockKey, parse_block_key


def test_parse_block_key_inverts_the_key_scheme() -> None:
    geometry = Geometry(
        groups=(GroupSpec.full(16), GroupSpec.mamba(32)), topology=Topology(tp_size=4, dcp_size=2)
    )
    scheme = KeyScheme(namespace="ns-a", model="m", geometry=geometry)
    for group_index in (0, 1):
        for tp_rank in range(4):
            key = scheme.key(group_index, tp_rank, bytes(range(32)))
            assert parse_block_key(key) == BlockKey(
                "ns-a", scheme.fingerprint, group_index, tp_rank, tp_rank % 2
            )
    assert parse_block_key(f"{scheme.geometry_prefix}manifest") is None
    assert parse_block_key("not/a/hybridkv/key") is None
