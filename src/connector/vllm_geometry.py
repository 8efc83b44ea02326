"""vLLM config -> the lifecycle's geometry and key scheme, resolved once per process.

The lifecycle (``hybridkv.lifecycle.geometry``) owns the arithmetic: spans, hash unit, hit alignment,
keys, the agreed boundary, load plans, truncation. This module only reads vLLM's objects and adds what
the worker needs to find bytes (each store group's ``kv_cache_groups`` index and layer names).

Invariant (checked at startup): the lifecycle's hash unit and hit alignment equal what vLLM resolved for
this deployment (``kv_cache_config.hash_block_size`` / ``cache_hit_alignment_tokens``). If they differed,
keys would name the wrong hashes or hits would land off vLLM's grid, so startup fails instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import structlog
from hybridkv.connector.identity import ModelIdentity, manifest, model_identity, write_manifest
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.lifecycle.geometry import Geometry, Topology
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import GroupKind, GroupSpec
from hybridkv.store import Status, Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GroupInfo:
    """Where a store group's bytes live: ``group_index`` = lifecycle group index, ``vllm_group_index`` = vLLM group index."""

    group_index: int
    vllm_group_index: int
    kind: GroupKind
    spec_name: str
    span: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class ConnectorGeometry:
    #: The key scheme resolved at engine start. A running scheduler's scheme is its lifecycle machine's
    #: (``LifecycleMachine.scheme``, rotated there by a reset); a worker's comes with each step's metadata.
    scheme: KeyScheme
    groups: tuple[GroupInfo, ...]
    identity: ModelIdentity

    @property
    def geometry(self) -> Geometry:
        return self.scheme.geometry

    @cached_property
    def group_to_vllm_group(self) -> tuple[int, ...]:
        """vLLM's KV cache group id of each store group (by store group index)."""
        return tuple(g.vllm_group_index for g in self.groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r.tp_rank for r in self.geometry.topology.ranks)

    def describe(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "namespace": self.scheme.namespace,
            "fingerprint": self.scheme.fingerprint,
            "key_prefix": self.scheme.geometry_prefix,
            "model": self.identity.model,
            "revision": self.identity.revision,
            "weights": self.identity.weights,
            "model_identity": self.identity.digest,
            "drafter": self.identity.drafter or None,
            "quantization": self.identity.quantization,
            "hash_unit": g.hash_unit,
            "hit_alignment": g.hit_alignment,
            "scheduler_block": g.scheduler_block_size,
            "tp": g.topology.tp_size,
            "dcp": g.topology.dcp_size,
            "groups": self._group_lines(),
        }

    def _group_lines(self) -> list[str]:
        return [
            f"{x.group_index}:{x.kind.value}/{x.spec_name} span={x.span} layers={len(x.layer_names)}"
            for x in self.groups
        ]

    def publish_manifest(self, store: Store, scheme: KeyScheme) -> None:
        """Record what the entries of ``scheme`` (this geometry's, with the weights tag the engine runs with
        now) are -- model, weights, dtypes, groups -- for ``hybridkv store ls``.

        Insert-if-absent under ``<key_prefix>manifest``; never a lookup key. Never raises: a store that fails
        here fails its lookups too, and those decline on their own.
        """
        try:
            status = write_manifest(store, scheme, manifest(scheme, self.identity, self._group_lines()))
        except Exception as exc:  # noqa: BLE001 -- the manifest is for people; the engine must start anyway
            log.warning(
                ConnectorLogEvent.MANIFEST_NOT_WRITTEN,
                key_prefix=scheme.geometry_prefix,
                error=repr(exc),
            )
            return
        if status is not Status.OK:
            log.warning(
                ConnectorLogEvent.MANIFEST_NOT_WRITTEN,
                key_prefix=scheme.geometry_prefix,
                status=status.value,
            )


def _layout(spec: Any) -> str:
    """What the bytes of one block look like (enters the fingerprint)."""
    fields = []
    for name in (
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "shapes",
        "dtypes",
        "mamba_type",
        "page_size_bytes",
    ):
        value = getattr(spec, name, None)
        if value is not None:
            fields.append(f"{name}={value}")
    return f"{type(spec).__name__}(" + ",".join(fields) + ")"


def _mamba_group(spec: Any, inner: Any, vllm_group_index: int) -> GroupSpec:
    if getattr(inner, "mamba_cache_mode", "align") != "align":
        raise ValueError(
            f"group {vllm_group_index} ({type(inner).__name__}): Mamba prefix caching needs mamba_cache_mode 'align', "
            f"got {inner.mamba_cache_mode!r}"
        )
    return GroupSpec.mamba(int(spec.block_size), layout=_layout(inner))


def _sliding_window_group(spec: Any, inner: Any, _gid: int) -> GroupSpec:
    return GroupSpec.sliding_window_group(
        int(spec.block_size), int(inner.sliding_window), layout=_layout(inner)
    )


def _full_group(spec: Any, inner: Any, _gid: int) -> GroupSpec:
    # Includes MLA, and sliding/chunked windows treated as full when HMA is off: storing every block of
    # those is still exact.
    return GroupSpec.full(int(spec.block_size), dcp_sharded=bool(spec.dcp_sharded), layout=_layout(inner))


def _spec_to_group() -> tuple[tuple[type, Callable[[Any, Any, int], GroupSpec]], ...]:
    """vLLM KV-cache spec type -> the lifecycle group it is, most specific first (the first match wins).
    What each kind may do (DCP, saves, loads) is its ``KIND_RULES`` row, not here."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    return (
        (MambaSpec, _mamba_group),
        (SlidingWindowSpec, _sliding_window_group),
        (FullAttentionSpec, _full_group),
    )


def hash_lookahead_tokens(vllm_config: VllmConfig) -> int:
    """vLLM 0.34's ``num_hash_lookahead_tokens`` (L): tokens past each block its hash covers. 0 on 0.32 (no
    such field) and 0.33 (0 whenever a connector is configured), and on 0.34 unless every connector opts in
    (``supports_lookahead_block_hashes``) and a drafter that drops blocks runs with prefix caching."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)


def _eagle_block_drop(vllm_config: VllmConfig) -> bool:
    """Whether vLLM drops a hit's last block for an EAGLE / MTP drafter (what its scheduler hands its KV
    cache coordinator as ``use_eagle``): never under lookahead hashes (vLLM 0.34's scheduler clears it
    when ``num_hash_lookahead_tokens > 0``)."""
    spec = vllm_config.speculative_config
    if spec is None or hash_lookahead_tokens(vllm_config):
        return False
    block_drop = getattr(spec, "use_eagle_block_drop", None)  # vLLM 0.32; older: every EAGLE drops
    return bool(block_drop() if callable(block_drop) else spec.use_eagle())


def resolve_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, namespace: str, *, check_vllm_sizes: bool
) -> ConnectorGeometry:
    """Build the key scheme; raise ``ValueError`` naming any group or size this connector cannot serve.

    ``check_vllm_sizes``: compare with vLLM's resolved hash unit / alignment (the scheduler's config has
    them; a worker's copy may not).
    """
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    par = vllm_config.parallel_config
    dcp = int(par.decode_context_parallel_size)
    tp = int(par.tensor_parallel_size)
    if int(getattr(par, "pipeline_parallel_size", 1)) != 1:
        raise ValueError(
            f"HybridStoreConnector does not support pipeline parallelism (pp={par.pipeline_parallel_size})"
        )
    if int(getattr(par, "prefill_context_parallel_size", 1)) != 1:
        raise ValueError(
            f"HybridStoreConnector does not support prefill context parallelism (pcp={par.prefill_context_parallel_size})"
        )
    interleave = int(getattr(par, "cp_kv_cache_interleave_size", 1) or 1)

    cacheable = tuple(kv_cache_config.prefix_cacheable_group_ids)
    specs: list[GroupSpec] = []
    infos: list[GroupInfo] = []
    for group_index, vllm_group_index in enumerate(cacheable):
        group = kv_cache_config.kv_cache_groups[vllm_group_index]
        spec = group.kv_cache_spec
        inner = spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            inner_specs = list(spec.kv_cache_specs.values())
            assert inner_specs and all(type(s) is type(inner_specs[0]) for s in inner_specs), (
                f"group {vllm_group_index}: mixed per-layer specs {sorted({type(s).__name__ for s in inner_specs})}"
            )
            inner = inner_specs[0]
        name = type(inner).__name__
        build = next((build for spec_type, build in _spec_to_group() if isinstance(inner, spec_type)), None)
        if build is None:
            raise ValueError(
                f"group {vllm_group_index}: KV-cache spec {name} is not supported by HybridStoreConnector"
            )
        gs = build(spec, inner, vllm_group_index)
        if dcp > 1 and not gs.rules.supports_dcp:
            raise ValueError(
                f"group {vllm_group_index}: {name} ({gs.kind.value}) cannot run under decode context parallelism (dcp={dcp})"
            )
        specs.append(gs)
        span = int(resolve_dcp_kv_block_size(spec, dcp))
        infos.append(GroupInfo(group_index, vllm_group_index, gs.kind, name, span, tuple(group.layer_names)))
    if not specs:
        raise ValueError("HybridStoreConnector: the model has no prefix-cacheable KV-cache group")

    other_spans = tuple(
        int(resolve_dcp_kv_block_size(g.kv_cache_spec, dcp))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if i not in cacheable
    )
    cc = vllm_config.cache_config
    # vLLM drops in the groups holding the drafter's layers (``is_eagle_group``), in every group when none is.
    flagged = {
        i for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "is_eagle_group", False)
    }
    eagle_groups = (
        frozenset(i for i, vllm_gid in enumerate(cacheable) if vllm_gid in flagged) if flagged else None
    )
    geometry = Geometry(
        groups=tuple(specs),
        topology=Topology(tp_size=tp, dcp_size=dcp, interleave=interleave),
        prefix_match_unit=getattr(cc, "prefix_match_unit", None) if len(specs) > 1 or other_spans else None,
        other_group_spans=other_spans,
        eagle=_eagle_block_drop(vllm_config),
        eagle_groups=eagle_groups,
        hash_lookahead=hash_lookahead_tokens(vllm_config),
    )
    for info, span in zip(infos, geometry.spans, strict=True):
        assert info.span == span, (
            f"group {info.vllm_group_index}: vLLM span {info.span} != lifecycle span {span}"
        )
    if check_vllm_sizes:
        vh = kv_cache_config.hash_block_size
        va = kv_cache_config.cache_hit_alignment_tokens
        if vh is not None and vh != geometry.hash_unit:
            raise ValueError(
                f"HybridStoreConnector: vLLM hashes every {vh} tokens but the geometry says {geometry.hash_unit}"
            )
        if va is not None and va != geometry.hit_alignment:
            raise ValueError(
                f"HybridStoreConnector: vLLM aligns hits to {va} tokens but the geometry says {geometry.hit_alignment}"
            )
    mc = vllm_config.model_config
    identity = model_identity(vllm_config)
    scheme = KeyScheme(
        namespace=namespace,
        model=str(mc.model).rstrip("/").split("/")[-1],
        geometry=geometry,
        kv_cache_dtype=f"{cc.cache_dtype}/{mc.dtype}",
        kv_cache_layout=str(kv_cache_config.kv_cache_layout or ""),
        hash_algorithm=str(getattr(cc, "prefix_caching_hash_algo", "sha256")),
        model_identity=identity.digest,
    )
    return ConnectorGeometry(scheme=scheme, groups=tuple(infos), identity=identity)
