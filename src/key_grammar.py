"""The key grammar: the version, the namespace rule, and the parse of a block entry's key.

A leaf module (the ground floor): it imports nothing of hybridkv, so the store (quotas, the chaos view),
the lifecycle (which builds keys: ``hybridkv.lifecycle.keys.KeyScheme``), the operator commands and the
connector's config all read one grammar without the store depending on the decision layer. Key strings
are a persistent format: changing this grammar is a ``KEY_VERSION`` change.

A block entry's key: ``<KEY_VERSION>/<namespace>/<fingerprint>/g<group>/tp<tp>/dcp<dcp>/<boundary hash>``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["KEY_VERSION", "NAMESPACE_RE", "BlockKey", "namespace_of", "parse_block_key"]

KEY_VERSION = "hkv1"
#: A deployment namespace: it becomes a key path segment (the one rule; the connector config uses it).
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

_KEY_PREFIX = f"{KEY_VERSION}/"
_BLOCK_KEY_RE = re.compile(
    rf"^{KEY_VERSION}/(?P<namespace>[^/]+)/(?P<fingerprint>[0-9a-f]{{12}})/g(?P<group>\d+)/tp(?P<tp>\d+)"
    r"/dcp(?P<dcp>\d+)/[0-9a-f]+$"
)


class BlockKey(NamedTuple):
    """The parts of a block entry's key (the inverse of ``hybridkv.lifecycle.keys.KeyScheme.key``)."""

    namespace: str
    fingerprint: str
    group_index: int
    tp_rank: int
    dcp_rank: int


def parse_block_key(key: str) -> BlockKey | None:
    """The parts of a block entry's key; None for any other key (a manifest, another tool's key)."""
    match = _BLOCK_KEY_RE.match(key)
    if match is None:
        return None
    return BlockKey(
        match["namespace"], match["fingerprint"], int(match["group"]), int(match["tp"]), int(match["dcp"])
    )


def namespace_of(key: str) -> str | None:
    """The namespace (a store's tenant) of ``key``: the segment after ``hkv1/``; ``None`` for a key of
    another form."""
    if not key.startswith(_KEY_PREFIX):
        return None
    end = key.find("/", len(_KEY_PREFIX))
    return key[len(_KEY_PREFIX) : end] if end > len(_KEY_PREFIX) else None
