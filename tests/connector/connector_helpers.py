"""Kept for tests that import ``connector_helpers``: everything lives in :mod:`hybridkv.testing.cluster`
(importable under any pytest import mode)."""

from __future__ import annotations

from hybridkv.testing.cluster import (
    HASH,
    Cluster,
    RankFaults,
    hybrid_config,
    kv_cache_config,
    kv_value,
    make_request,
    make_vllm_objs,
    state_value,
)

__all__ = [
    "HASH",
    "Cluster",
    "RankFaults",
    "hybrid_config",
    "kv_cache_config",
    "kv_value",
    "make_request",
    "make_vllm_objs",
    "state_value",
]
