"""Store keys and fingerprints are a persistent format: these values are pinned.

Entries written by one release must be found by the next, so a change to any value below is a key
format change (bump ``KEY_VERSION``), never a side effect of moving code. The lookup and save plans
are pinned too: they are the keys a deployment actually reads and writes.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology, plan_lookup, plan_save

BLOCK_HASHES = [hashlib.sha256(str(i).encode()).digest() for i in range(16)]

SCHEMES = {
    "single_full": KeyScheme(namespace="prod", model="m", geometry=Geometry(groups=(GroupSpec.full(16),))),
    "full_mamba_dcp2": KeyScheme(
        namespace="ns.1",
        model="m",
        geometry=Geometry(
            groups=(GroupSpec.full(16, layout="bf16"), GroupSpec.mamba(64, layout="s")),
            topology=Topology(tp_size=4, dcp_size=2, interleave=16),
        ),
        kv_cache_dtype="fp8",
    ),
    "full_swa": KeyScheme(
        namespace="a-b_c",
        model="x",
        model_identity="sha:abc",
        geometry=Geometry(
            groups=(GroupSpec.full(32), GroupSpec.sliding_window_group(32, 100)), prefix_match_unit=16
        ),
    ),
    "full_mamba_fine": KeyScheme(
        namespace="n",
        model="m",
        geometry=Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(64)), other_group_spans=(32,)),
    ),
}

HASH_HEX = "4e07408562bedb8b60ce05c1decfe3ad16b72230967de01f640b7e4729b49fce"

#: name -> (fingerprint, key of the last group on the last rank for hash 3, hash unit, hit alignment,
#: scheduler block, fine-grained, number of lookup candidate keys, digest of the candidate keys)
PINNED = {
    "single_full": (
        "699a6ec20a66",
        f"hkv1/prod/699a6ec20a66/g0/tp0/dcp0/{HASH_HEX}",
        (16, 16, 16, False),
        (16, "1dcfe814fdfc8067"),
    ),
    "full_mamba_dcp2": (
        "16a46fb867c3",
        f"hkv1/ns.1/16a46fb867c3/g1/tp3/dcp1/{HASH_HEX}",
        (32, 32, 64, True),
        (128, "421d6e2be770b046"),
    ),
    "full_swa": (
        "882f8a608013",
        f"hkv1/a-b_c/882f8a608013/g1/tp0/dcp0/{HASH_HEX}",
        (16, 32, 32, False),
        (16, "1df342110bbedfd7"),
    ),
    "full_mamba_fine": (
        "f1182976cfbd",
        f"hkv1/n/f1182976cfbd/g1/tp0/dcp0/{HASH_HEX}",
        (16, 16, 64, True),
        (32, "ca375ddb541ede03"),
    ),
}


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_keys_and_fingerprints_are_pinned(name: str) -> None:
    scheme, (fingerprint, key, sizes, (num_keys, keys_digest)) = SCHEMES[name], PINNED[name]
    geometry = scheme.geometry
    assert scheme.fingerprint == fingerprint
    assert scheme.key(geometry.num_groups - 1, geometry.topology.tp_size - 1, BLOCK_HASHES[3]) == key
    assert (
        geometry.hash_unit,
        geometry.hit_alignment,
        geometry.scheduler_block_size,
        geometry.fine_grained,
    ) == sizes
    candidates = plan_lookup(scheme, BLOCK_HASHES, 16 * geometry.hash_unit + 1)
    assert (len(candidates.keys), _digest(list(candidates.keys))) == (num_keys, keys_digest)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_key_builder_follows_the_one_rule(name: str) -> None:
    """The lookup's key builders (from hex hashes, one rank, every rank, a slice of boundaries) give the
    bytes ``KeyScheme.key`` gives for the hash ``KeyScheme.boundary_hash`` picks."""
    scheme = SCHEMES[name]
    geometry = scheme.geometry
    block_hex = [block_hash.hex() for block_hash in BLOCK_HASHES]
    boundaries = [geometry.hash_unit * (i + 1) for i in range(len(BLOCK_HASHES))]
    for g in range(geometry.num_groups):
        for r in range(len(geometry.topology.ranks)):
            expected = [scheme.key(g, r, scheme.boundary_hash(BLOCK_HASHES, b)) for b in boundaries]
            assert [scheme.boundary_key(g, r, block_hex, b) for b in boundaries] == expected
            assert scheme.boundaries_keys(g, r, block_hex, boundaries) == expected
        assert [scheme.boundary_rank_keys(g, block_hex, b) for b in boundaries] == [
            [
                scheme.key(g, r, scheme.boundary_hash(BLOCK_HASHES, b))
                for r in range(len(geometry.topology.ranks))
            ]
            for b in boundaries
        ]


#: name -> (agreed boundary with every candidate present, number and digest of the load plan's
#: (entry, key) pairs, number and digest of the save plan's)
PINNED_PLANS = {
    "single_full": (256, (16, "c3531f33561514d4"), (16, "c3531f33561514d4")),
    "full_mamba_dcp2": (512, (68, "476adcb518bc51bb"), (96, "ca2c0253dc55c070")),
    "full_swa": (256, (12, "287978d97d9c6af3"), (24, "7f0aebd0ca82beb4")),
    "full_mamba_fine": (256, (17, "d7c0934b14bc7392"), (20, "8db42e0c7b18b655")),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_load_and_save_plans_are_pinned(name: str) -> None:
    scheme = SCHEMES[name]
    geometry = scheme.geometry
    boundary, (num_loads, loads_digest), (num_saves, saves_digest) = PINNED_PLANS[name]
    candidates = plan_lookup(scheme, BLOCK_HASHES, 16 * geometry.hash_unit + 1)
    result = candidates.resolve([True] * len(candidates.keys))
    assert result.plan is not None and result.boundary == boundary
    loads = [f"{entry} {key}" for entry, key in result.plan.entries]
    assert (len(loads), _digest(loads)) == (num_loads, loads_digest)
    # Group 0 saves every hash boundary (whole blocks and tails), the others whole blocks only.
    boundaries = [geometry.hash_unit * (i + 1) for i in range(len(BLOCK_HASHES))]
    group_to_boundaries = {
        g: [b for b in boundaries if b % (geometry.spans[g] if g else geometry.hash_unit) == 0]
        for g in range(geometry.num_groups)
    }
    saves = [f"{entry} {key}" for entry, key in plan_save(scheme, BLOCK_HASHES, group_to_boundaries).entries]
    assert (len(saves), _digest(saves)) == (num_saves, saves_digest)


def _with_lookahead(scheme: KeyScheme, hash_lookahead: int) -> KeyScheme:
    return dataclasses.replace(
        scheme, geometry=dataclasses.replace(scheme.geometry, hash_lookahead=hash_lookahead)
    )


#: name -> fingerprint under vLLM 0.34's lookahead block hashes with L = 1 (EAGLE) and L = 3 (3-module MTP)
PINNED_LOOKAHEAD = {
    "single_full": ("65ddba08c98b", "65ed7ffd5618"),
    "full_mamba_dcp2": ("0b41a592a6d9", "c39bebbde629"),
    "full_swa": ("c99a7a08ad00", "b8ed841beb1e"),
    "full_mamba_fine": ("08e195c27073", "9a9e13014b69"),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_hash_lookahead_joins_the_fingerprint_and_l0_keys_stay_pinned(name: str) -> None:
    """vLLM 0.34's lookahead hashes (L tokens past each block in its hash) are part of what a key means:
    engines with different L never read each other's entries, engines with equal L share, and L = 0 (every
    engine before 0.34, and 0.34 without the opt-in) keeps the pinned fingerprint above byte for byte."""
    scheme = SCHEMES[name]
    assert _with_lookahead(scheme, 0).fingerprint == PINNED[name][0]
    eagle, mtp = _with_lookahead(scheme, 1), _with_lookahead(scheme, 3)
    assert (eagle.fingerprint, mtp.fingerprint) == PINNED_LOOKAHEAD[name]
    assert len({scheme.fingerprint, eagle.fingerprint, mtp.fingerprint}) == 3
    assert _with_lookahead(scheme, 3).fingerprint == mtp.fingerprint  # equal L: one fingerprint
    key = eagle.key(0, 0, BLOCK_HASHES[3])
    assert key.startswith(f"hkv1/{scheme.namespace}/{eagle.fingerprint}/") and key != scheme.key(
        0, 0, BLOCK_HASHES[3]
    )


def test_hash_lookahead_turns_the_eagle_drop_off() -> None:
    """vLLM's scheduler clears the EAGLE drop under lookahead hashes; a geometry claiming both is a bug."""
    with pytest.raises(AssertionError, match="vLLM turns the EAGLE drop off"):
        Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(64)), eagle=True, hash_lookahead=1)
    geometry = Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(64)), hash_lookahead=3)
    assert geometry.eagle_lookahead == 0 and geometry.num_unfinal_tokens == 2
    assert Geometry(groups=(GroupSpec.full(16),)).num_unfinal_tokens == 0
