"""Store keys: one entry per (group, rank, boundary hash) under a versioned, fingerprinted prefix.

The block (or fine-grained tail) that ends at token ``t`` is keyed by ``block_hashes[t // h - 1]``
(vLLM: a coarse block's hash is its last fine hash). A tail is always addressed by the boundary it was
stored under; a shorter boundary is never derived from a longer key. Key strings and fingerprints are a
persistent format: changing them is a ``KEY_VERSION`` change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from hybridkv.key_grammar import KEY_VERSION, NAMESPACE_RE, BlockKey, parse_block_key
from hybridkv.lifecycle.geometry import Geometry

__all__ = [
    "KEY_VERSION",
    "NAMESPACE_RE",
    "BlockKey",
    "EntryId",
    "KeyScheme",
    "PlannedBlock",
    "parse_block_key",
]

# The grammar (version, namespace rule, a key's parse) lives on the ground floor, ``hybridkv.key_grammar``;
# this module builds keys by it and re-exports its names for the lifecycle's readers.


class EntryId(NamedTuple):
    """One stored entry of a plan: a group block on a rank, stored under ``key_boundary``.

    The boundary is part of the identity: one block may hold several entries (a whole block and a
    prompt tail, or Mamba states at several hash boundaries of one block).
    """

    tp_rank: int
    group_index: int
    block_index: int
    key_boundary: int


@dataclass(frozen=True)
class PlannedBlock:
    """One group block a load or save plan moves: ``block_index`` in the group's block table, as the
    entry ending at ``key_boundary`` (keyed by ``block_hash``, the hash of that boundary)."""

    group_index: int
    block_index: int
    key_boundary: int
    block_hash: bytes

    def entry(self, tp_rank: int) -> EntryId:
        """The entry of this block on ``tp_rank``."""
        return EntryId(tp_rank, self.group_index, self.block_index, self.key_boundary)


def boundary_hash_index(boundary_tokens: int, hash_unit: int) -> int:
    """The key rule: an entry ending at ``boundary_tokens`` is keyed by the request's block hash at this
    index (vLLM's hash of the prefix up to the boundary, one hash per ``hash_unit`` tokens)."""
    assert boundary_tokens > 0 and boundary_tokens % hash_unit == 0, (
        f"boundary {boundary_tokens} is not a positive multiple of the hash unit {hash_unit}"
    )
    return boundary_tokens // hash_unit - 1


@dataclass(frozen=True, kw_only=True)
class KeyScheme:
    """Store keys: ``hkv1/<namespace>/<fingerprint>/g<group>/tp<r>/dcp<r>/<hash hex>``.

    ``prefix`` removes every entry of a deployment (namespace); ``geometry_prefix`` every entry of one
    geometry. The fingerprint covers the model's identity, dtypes, layout, hash algorithm, every group
    spec, sizes, hash unit, TP/DCP sizes and interleave, so incompatible deployments never read each
    other's bytes.

    ``model_identity`` is what identifies the weights and model options (``hybridkv.connector.identity``:
    weight files, revision, quantization, overrides, RoPE scaling); when set, it replaces ``model`` (a
    display name) in the fingerprint, so the same weights in two folders share entries and two models
    in folders of one name do not.
    """

    namespace: str
    model: str
    geometry: Geometry
    kv_cache_dtype: str = "auto"
    kv_cache_layout: str = ""
    hash_algorithm: str = "sha256"
    model_identity: str = ""
    #: Which weights computed the KV beyond the checkpoint's identity: the operator's ``weights_version``,
    #: and a per-reset suffix once an engine may run updated weights (``with_weights_tag``). Empty: the
    #: checkpoint's own weights (not in the fingerprint, so such keys stay as they always were).
    weights_tag: str = ""

    def __post_init__(self) -> None:
        assert NAMESPACE_RE.match(self.namespace), (
            f"namespace {self.namespace!r} must match {NAMESPACE_RE.pattern} (it becomes a key path segment)"
        )

    @cached_property
    def fingerprint(self) -> str:
        payload = {
            "version": KEY_VERSION,
            "model": self.model_identity or self.model,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_cache_layout": self.kv_cache_layout,
            "hash_algorithm": self.hash_algorithm,
            "geometry": self.geometry.describe(),
        }
        if self.weights_tag:
            payload["weights"] = self.weights_tag
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def with_weights_tag(self, weights_tag: str) -> KeyScheme:
        """This scheme for KV computed by weights ``weights_tag`` (another fingerprint, same namespace)."""
        return dataclasses.replace(self, weights_tag=weights_tag)

    @cached_property
    def prefix(self) -> str:
        return f"{KEY_VERSION}/{self.namespace}/"

    @cached_property
    def geometry_prefix(self) -> str:
        return f"{self.prefix}{self.fingerprint}/"

    @cached_property
    def group_rank_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """``[group][tp_rank]``: the key of an entry is its prefix plus the boundary hash in hex."""
        base = self.geometry_prefix
        return tuple(
            tuple(f"{base}g{g}/tp{r.tp_rank}/dcp{r.dcp_rank}/" for r in self.geometry.topology.ranks)
            for g in range(self.geometry.num_groups)
        )

    def key(self, group_index: int, tp_rank: int, block_hash: bytes) -> str:
        """The key of the entry of ``group_index`` on ``tp_rank`` whose boundary hash is ``block_hash``."""
        return self.group_rank_prefixes[group_index][tp_rank] + block_hash.hex()

    def boundary_hash(self, block_hashes: Sequence[bytes], boundary_tokens: int) -> bytes:
        """The hash that keys an entry ending at ``boundary_tokens`` (a multiple of the hash unit)."""
        return block_hashes[boundary_hash_index(boundary_tokens, self.geometry.hash_unit)]

    def boundary_key(
        self, group_index: int, tp_rank: int, block_hex: Sequence[str], boundary_tokens: int
    ) -> str:
        """``key`` of the entry of ``group_index`` on ``tp_rank`` ending at ``boundary_tokens``, from the
        request's block hashes already in hex (``block_hex[i] == block_hashes[i].hex()``: a lookup makes
        them once and builds thousands of keys from them)."""
        hash_hex = block_hex[boundary_hash_index(boundary_tokens, self.geometry.hash_unit)]
        return self.group_rank_prefixes[group_index][tp_rank] + hash_hex

    def boundary_rank_keys(
        self, group_index: int, block_hex: Sequence[str], boundary_tokens: int
    ) -> list[str]:
        """``boundary_key`` on every rank, in rank order."""
        hash_hex = block_hex[boundary_hash_index(boundary_tokens, self.geometry.hash_unit)]
        return [prefix + hash_hex for prefix in self.group_rank_prefixes[group_index]]

    def boundaries_keys(
        self, group_index: int, tp_rank: int, block_hex: Sequence[str], boundaries: Sequence[int]
    ) -> list[str]:
        """``boundary_key`` of each of ``boundaries`` (candidate boundaries: positive multiples of the hash
        unit), in one call: a lookup probes thousands of boundaries, and a call per key would double the
        cost of its probe. The rule of ``boundary_hash_index``, applied to a whole slice."""
        prefix = self.group_rank_prefixes[group_index][tp_rank]
        hash_unit = self.geometry.hash_unit
        return [prefix + block_hex[boundary // hash_unit - 1] for boundary in boundaries]

    def entries(self, blocks: Sequence[PlannedBlock]) -> tuple[tuple[EntryId, str], ...]:
        """Every (entry, key) of ``blocks`` on every rank, rank-major."""
        return tuple(
            (block.entry(rank.tp_rank), self.key(block.group_index, rank.tp_rank, block.block_hash))
            for rank in self.geometry.topology.ranks
            for block in blocks
        )

    def rank_keys(self, blocks: Iterable[PlannedBlock], tp_rank: int) -> list[tuple[PlannedBlock, str]]:
        """``blocks`` with their keys on ``tp_rank``."""
        return [(block, self.key(block.group_index, tp_rank, block.block_hash)) for block in blocks]
