"""Tiny random-weight models for end-to-end tests on CPU (no download).

Contract: ``build_tiny_model(family, out_dir)`` returns a folder that vLLM (CPU build) can load, with token-id
prompts (``skip_tokenizer_init=True``) or with text: the folder holds a real tokenizer (a byte-level BPE
built with the ``tokenizers`` library, exactly ``vocab_size`` ids, so every id the model can sample decodes)
and a chat template, so the OpenAI server answers ``/v1/completions`` and ``/v1/chat/completions`` with text
and ``vllm bench serve`` can drive it. Weights are random with a fixed seed, stored in bfloat16. The folder
name carries a digest of the config (and builder version), so a repeat call with the same arguments returns
the existing folder at once; a folder is published by atomic rename, so a crashed build is never reused. The
tokenizer is not part of the digest: a folder built before it existed gets its tokenizer files added (each
written atomically, ``tokenizer_config.json`` last), weights untouched.

Families and the KV-cache groups vLLM makes of them (facts from ``docs/vllm-cpu-e2e.md``):

- ``llama``       -- 1 group, full attention.
- ``gemma3``      -- 2 groups, sliding window (64) + full attention.
- ``qwen3_next``  -- 2 groups, GDN linear attention (Mamba spec) + full attention, block 128.
- ``lfm2``        -- 2 groups, short convolution (Mamba spec) + full attention, block 128.
- ``deepseek_v3`` -- 1 group, MLA (latent 512 + rope 64 = head size 576, the only one vLLM's CPU MLA
  backends take), MoE. Not in ``FAMILIES`` (the demo, bench and serve families): vLLM keeps prefix
  caching on for it only with the ``AMX_MLA`` backend; with ``CPU_MLA`` it turns prefix caching off.

Sliding-window families, not in ``FAMILIES`` either (for end-to-end tests):

- ``cohere2``     -- 4 groups: 3 sliding-window (64) + 1 full attention, one layer each
  (``[sliding, sliding, sliding, full]``).
- ``gemma2``      -- 2 groups, sliding window (64) + full attention (logit soft-capping on).
- ``gpt_oss``     -- 2 groups, sliding window (64) + full attention, attention sinks, MoE (4 experts, 2
  active).
- ``olmo3``       -- 4 groups: 3 sliding-window (64) + 1 full attention, one layer each (Olmo3's own
  ``[sliding, sliding, sliding, full]``, QK-norm); vLLM 0.32 runs it through its Transformers modeling
  backend (``TransformersForCausalLM``).

Sizes: ``size="tiny"`` (default; hidden 128, 2-4 layers), ``size="bench"`` (hidden 1024, 8 layers, 4 KV
heads x 128, long context): big enough that prefill compute dominates a 4000-token request on CPU, for
``hybridkv bench ttft``, and ``size="long"`` (the tiny model with 32K positions: prompts of 8K-32K tokens that
a CPU host prefills in seconds, for ``hybridkv bench serve``). A size only adds overrides, so ``tiny`` folders
keep their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = ("llama", "gemma3", "qwen3_next", "lfm2")
#: The one models directory: tests, benchmarks and tools build and reuse tiny models here
#: (``$HYBRIDKV_TEST_MODELS``, else a fixed folder under /tmp).
DEFAULT_MODELS_DIR = Path(os.environ.get("HYBRIDKV_TEST_MODELS", "/tmp/hybridkv-test-models"))

#: Per family: the transformers config class and model class.
_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
}

#: Per hybrid family: the layer types its layers repeat (``None``: every layer full attention).
_LAYER_PATTERN: dict[str, tuple[str, ...] | None] = {
    "llama": None,
    "gemma3": ("sliding_attention", "full_attention"),
    "qwen3_next": ("linear_attention", "full_attention"),
    "lfm2": ("conv", "full_attention"),
    "deepseek_v3": None,
    "cohere2": ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention"),
    "gemma2": ("sliding_attention", "full_attention"),
    "gpt_oss": ("sliding_attention", "full_attention"),
    "olmo3": ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention"),
}

#: Bump when the builder changes the produced files for an unchanged config.
_BUILDER_VERSION = 1

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "num_attention_heads": 4,
}


#: Model sizes of ``build_tiny_model`` (every CLI that takes ``--size`` offers these, described by ``SIZES_HELP``).
SIZES: tuple[str, ...] = ("tiny", "bench", "long")
SIZES_HELP = (
    "tiny = the test models; bench = hidden 1024, 8 layers, 4 KV heads x 128; long = tiny with 32K positions, "
    "for prompts of 8K-32K tokens"
)
#: Overrides of ``size="long"``: the tiny model, with positions for prompts of up to 32K tokens (long-context
#: serving on CPU hosts, where the bench size prefills a 9K-token prompt in tens of seconds).
_LONG_COMMON: dict[str, Any] = {"max_position_embeddings": 32768}

#: Overrides of ``size="bench"`` shared by every family: hidden 1024, 8 query heads, 4 KV heads x 128.
_BENCH_COMMON: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "max_position_embeddings": 32768,
}


def _check_family(family: str) -> None:
    if family not in _CLASSES:
        raise ValueError(f"unknown tiny model family {family!r}; expected one of {tuple(_CLASSES)}")


def _layer_types(family: str, num_layers: int) -> list[str]:
    """``num_layers`` layer types of a hybrid family: its pattern, repeated."""
    pattern = _LAYER_PATTERN[family]
    assert pattern is not None, family
    return list(pattern) * (num_layers // len(pattern))


def size_overrides(family: str, size: str) -> dict[str, Any]:
    """Config overrides a ``size`` adds to a family's tiny config (``{}`` for ``tiny``)."""
    if size == "tiny":
        return {}
    if size == "long":
        _check_family(family)
        return dict(_LONG_COMMON)
    if size != "bench":
        raise ValueError(f"unknown model size {size!r}; expected one of {SIZES}")
    _check_family(family)
    kw: dict[str, Any] = dict(_BENCH_COMMON)
    if _LAYER_PATTERN[family] is not None:
        kw["layer_types"] = _layer_types(family, kw["num_hidden_layers"])
    if family in ("llama", "gemma3", "qwen3_next"):
        kw["head_dim"] = 128
    if family == "gemma3":
        kw["query_pre_attn_scalar"] = 128
    if family == "qwen3_next":
        # GDN: 2 key heads, 4 value heads of 128; MoE of 8 experts (2 active) ~ the dense MLP's compute.
        kw.update(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=8,
            moe_intermediate_size=704,
            shared_expert_intermediate_size=704,
        )
    if family == "lfm2":
        kw.update(conv_dim=1024, block_dim=1024)
    return kw


def _sliding_kwargs(family: str, *, head_dim: int | None = 32) -> dict[str, Any]:
    """What the sliding-window families share: 4 layers of the family's pattern, a window of 64 tokens,
    2 KV heads (of ``head_dim``, when the config takes one)."""
    kw: dict[str, Any] = {
        "num_hidden_layers": 4,
        "layer_types": _layer_types(family, 4),
        "sliding_window": 64,
        "num_key_value_heads": 2,
    }
    return kw if head_dim is None else kw | {"head_dim": head_dim}


def tiny_config_kwargs(family: str, *, size: str = "tiny", **overrides: Any) -> tuple[str, dict[str, Any]]:
    """The transformers config class name and kwargs of a family at ``size`` (overrides win)."""
    _check_family(family)
    cls = _CLASSES[family][0]
    if family == "llama":
        kw: dict[str, Any] = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 32}
    elif family in ("gemma3", "gemma2"):
        # vLLM's Gemma2 always takes the LM head from the embedding. Tied, the random model repeats a token
        # for a stretch whatever the initializer range; which token, and where it switches, depends on the
        # whole prompt.
        kw = _sliding_kwargs(family) | {"query_pre_attn_scalar": 32, "tie_word_embeddings": True}
    elif family == "qwen3_next":
        kw = {
            "num_hidden_layers": 4,
            "layer_types": _layer_types(family, 4),
            "linear_conv_kernel_dim": 4,
            # The CPU GDN kernel rejects head dim 32; 128 works. 4 kv heads x 128 keeps the block at 128.
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
        }
    elif family == "deepseek_v3":
        kw = {
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            # MLA: vLLM's CPU MLA backends take only head size 576 = kv_lora_rank 512 + qk_rope_head_dim 64.
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "q_lora_rank": None,
            # Layer 0 dense, layer 1 MoE (4 routed experts, 2 active, 1 shared).
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "n_group": 1,
            "topk_group": 1,
            # Without these vLLM cannot load the gate's ``e_score_correction_bias``.
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_nextn_predict_layers": 0,
            # With the default 0.02 the random model repeats one token; 0.2 gives varied tokens.
            "initializer_range": 0.2,
        }
    elif family == "cohere2":
        # Its config derives head dim (hidden 128 / 4 heads = 32). With the default initializer range 0.02
        # the random model repeats one token; 0.2 gives varied tokens.
        kw = _sliding_kwargs(family, head_dim=None) | {"initializer_range": 0.2}
    elif family == "gpt_oss":
        kw = _sliding_kwargs(family) | {"num_local_experts": 4, "num_experts_per_tok": 2}
    elif family == "olmo3":
        # Its config derives head dim (hidden 128 / 4 heads = 32). With initializer range 0.02 (the default)
        # to 0.5 the random model (QK-norm, post-norms) repeats 3-4 tokens over 16; 1.0 gives varied tokens.
        kw = _sliding_kwargs(family, head_dim=None) | {"initializer_range": 1.0}
    else:  # lfm2
        kw = {
            "num_hidden_layers": 4,
            "layer_types": _layer_types(family, 4),
            "num_key_value_heads": 2,
            "conv_L_cache": 3,
            "block_multiple_of": 64,
            "block_auto_adjust_ff_dim": False,
            # vLLM's lfm2.py reads these; HF's Lfm2Config lacks them.
            "conv_dim": 128,
            "block_dim": 128,
            "tie_word_embeddings": True,
        }
    merged = {**_COMMON, **kw, **size_overrides(family, size), **overrides}
    return cls, merged


def _folder_digest(payload: dict[str, Any]) -> str:
    """The 16 hex digits naming a built folder: what it was built from, canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _digest(family: str, cls_name: str, kwargs: dict[str, Any], seed: int) -> str:
    return _folder_digest(
        {"family": family, "cls": cls_name, "kwargs": kwargs, "seed": seed, "v": _BUILDER_VERSION}
    )


def _patch_config(folder: Path, updates: dict[str, Any]) -> None:
    """Set ``updates`` in ``folder``'s ``config.json`` (``save_pretrained`` may drop keys vLLM needs)."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) | updates
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def build_tiny_model(
    family: str, out_dir: Path, *, seed: int = 0, size: str = "tiny", **overrides: Any
) -> Path:
    """Build (or reuse) a random-weight model of ``family`` (at ``size``) under ``out_dir``; return its folder."""
    cls_name, kwargs = tiny_config_kwargs(family, size=size, **overrides)
    out_dir = Path(out_dir)
    target = out_dir / f"{family}-{_digest(family, cls_name, kwargs, seed)}"
    if (target / "config.json").is_file():
        ensure_tokenizer(target, vocab_size=int(kwargs["vocab_size"]))
        return target

    import torch
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    arch = _CLASSES[family][1]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.bfloat16)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        # Keys transformers does not know (DeepSeek-V3's routing keys too: HF's config may not write them back).
        kept = {
            key: kwargs[key]
            for key in ("conv_dim", "block_dim", "topk_method", "scoring_func")
            if key in kwargs
        }
        _patch_config(tmp, kept | {"torch_dtype": "bfloat16"})

    _publish(target, write)
    ensure_tokenizer(target, vocab_size=int(kwargs["vocab_size"]))
    return target


def _publish(target: Path, write: Callable[[Path], None]) -> None:
    """Write a model folder into a temp folder beside ``target`` (``write``), then rename it to ``target``
    atomically; another process that published the same digest first wins (its files are equivalent)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name.rsplit('-', 1)[0]}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


#: Draft builder version (bump when ``build_eagle_draft`` writes other files for the same target).
_EAGLE_BUILDER_VERSION = 1


def build_eagle_draft(target_dir: Path, out_dir: Path, *, seed: int = 1) -> Path:
    """Build (or reuse) a random-weight one-layer EAGLE drafter for the ``llama`` tiny model in
    ``target_dir``, under ``out_dir``; return its folder.

    vLLM's ``EagleLlamaForCausalLM`` layout: ``fc`` ([hidden, 2 x hidden]: the token embedding and the
    target's hidden state in, one hidden state out), one decoder layer without its input layernorm, no final
    norm; embeddings and LM head are shared with the target (the checkpoint has none). vLLM names the
    drafter's attention layer after the target's layers (``model.layers.<num target layers>``) and puts it
    in the target's KV-cache group. Same publication rules as ``build_tiny_model``.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    if target_cfg.get("model_type") != "llama":
        raise ValueError(
            f"EAGLE drafts are built for the llama tiny model, not {target_cfg.get('model_type')!r}"
        )
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    kwargs = {k: target_cfg[k] for k in keys if k in target_cfg}
    kwargs |= {"num_hidden_layers": 1, "max_position_embeddings": target_cfg["max_position_embeddings"]}
    digest = _folder_digest({"kwargs": kwargs, "seed": seed, "v": _EAGLE_BUILDER_VERSION})
    target = Path(out_dir) / f"eagle-llama-{digest}"
    if (target / "config.json").is_file():
        return target
    config = transformers.LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    layer = transformers.LlamaForCausalLM(config).model.layers[0].to(torch.bfloat16)  # type: ignore[no-untyped-call]
    hidden = int(kwargs["hidden_size"])
    weights = {
        f"layers.0.{name}": tensor.contiguous()
        for name, tensor in layer.state_dict().items()
        if not name.startswith("input_layernorm.")
    }
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5).to(torch.bfloat16)
    cfg = config.to_dict() | {"architectures": ["EagleLlamaForCausalLM"], "torch_dtype": "bfloat16"}

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))

    _publish(target, write)
    return target


#: Special tokens at fixed ids, matching ``_COMMON``'s pad/bos/eos ids.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>")

#: Role markers of the chat template (plain text to the tokenizer: byte-level BPE spells any string).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

#: Training text of the tokenizer's merges: fixed, so the tokenizer is the same on every machine.
_TOKENIZER_CORPUS = (
    "You are a helpful assistant. Answer the question about the system, the cache and the store. "
    "The user asks how the prefix cache works when many sessions share one system prompt and the "
    "local memory is too small to hold them all. The assistant explains that blocks are saved to an "
    "external store and loaded back when a conversation returns, so the model does not compute the "
    "same tokens twice. Sessions, turns, requests, tokens, latency, throughput, eviction, memory, "
    "attention, layers, hidden states, sliding windows, convolution, recurrent state, kernels, "
    "scheduler, worker, connector, metrics, counters, errors, retries, timeouts, failures, recovery. "
    "Please summarise the previous answer in one sentence and then list three follow-up questions "
    "that an operator would ask before running this in production with thousands of users.\n"
)


def ensure_tokenizer(model_dir: Path, *, vocab_size: int) -> None:
    """Write the tokenizer files of ``model_dir`` unless present: a byte-level BPE of exactly
    ``vocab_size`` ids (``<pad>``/``<s>``/``</s>`` at 0/1/2, the 256 byte symbols, merges trained on a fixed
    text), ``tokenizer_config.json`` with the chat template, and ``special_tokens_map.json``."""
    config_path = model_dir / "tokenizer_config.json"
    if config_path.is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The corpus repeated with varied spacing and case: enough distinct pairs for every merge.
    lines = [_TOKENIZER_CORPUS, _TOKENIZER_CORPUS.upper(), _TOKENIZER_CORPUS.title()]
    lines += [
        " ".join(reversed(_TOKENIZER_CORPUS.split())),
        "0123456789 " * 8,
        "{}[]()<>|/\\:;,.!?'\"-_=+*&^%$#@~`",
    ]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    assert tokenizer.get_vocab_size() == vocab_size, (
        f"tokenizer of {model_dir.name}: {tokenizer.get_vocab_size()} ids, the model has {vocab_size}"
    )
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, f"special token {token!r} not at id {index}"
    pad, bos, eos = SPECIAL_TOKENS
    files: dict[str, str] = {
        "tokenizer.json": tokenizer.to_str(),
        "special_tokens_map.json": json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad}),
        # Last: its presence means the tokenizer is complete.
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": bos,
                "eos_token": eos,
                "pad_token": pad,
                "add_bos_token": False,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        ),
    }
    for name, text in files.items():
        fd, tmp_name = tempfile.mkstemp(prefix=f".{name}-", dir=model_dir)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp_name, model_dir / name)


# ---------------------------------------------------------------------------------------------------------
# Mamba2 hybrids: config folders only. vLLM-CPU cannot serve them with prefix caching (its Mamba2 kernel
# fails in ``mamba_mixer2.py``), so they are tested at the Scheduler level, where a ``config.json`` is all
# vLLM reads (``ModelConfig``, the model class's ``get_mamba_state_*_from_config``), and weights never load.
# ---------------------------------------------------------------------------------------------------------

#: Per Mamba2 hybrid family: the transformers config class and the architecture vLLM resolves.
MAMBA2_HYBRID_CLASSES: dict[str, tuple[str, str]] = {
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM"),
}

#: Bump when ``build_tiny_config`` writes another ``config.json`` for unchanged arguments.
_CONFIG_BUILDER_VERSION = 1


def mamba2_hybrid_config_kwargs(family: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """The transformers config class name and kwargs of a tiny Mamba2 hybrid (overrides win).

    Every family mixes Mamba2 and attention layers; the Mamba2 mixer has 8 heads of 16 in 2 groups
    (state 16, conv kernel 4) and attention has 2 KV heads of 32 (Zamba2: 4 of 64, it attends over
    the concatenated embeddings), so TP 2 splits both:

    - ``nemotron_h``: pattern ``M*M-`` (Mamba2, attention, Mamba2, MLP);
    - ``falcon_h1``: 2 parallel-hybrid layers (attention and Mamba2 side by side in every layer);
    - ``granitemoehybrid``: Mamba2, attention, Mamba2, attention, dense MLPs (no experts);
    - ``zamba2``: Mamba2, hybrid, Mamba2, hybrid (a hybrid layer: the shared attention block plus Mamba2).
    """
    if family not in MAMBA2_HYBRID_CLASSES:
        raise ValueError(
            f"unknown Mamba2 hybrid family {family!r}; expected one of {tuple(MAMBA2_HYBRID_CLASSES)}"
        )
    mamba: dict[str, Any]
    if family == "nemotron_h":
        mamba = {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16}
        kw: dict[str, Any] = {
            "hybrid_override_pattern": "M*M-",
            "num_key_value_heads": 2,
            "head_dim": 32,
            "conv_kernel": 4,
            "expand": 1,
            **mamba,
        }
    elif family == "zamba2":
        kw = {
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
            "num_key_value_heads": 4,
            "num_mem_blocks": 1,
            "n_mamba_heads": 8,
            "mamba_ngroups": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 1,
        }
    else:
        mamba = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16}
        mamba |= {"mamba_d_conv": 4, "mamba_expand": 1}
        if family == "falcon_h1":
            # HF validates mamba_d_ssm (or expand x hidden) == heads x head dim: 128 = 8 x 16.
            kw = {
                "num_hidden_layers": 2,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "mamba_d_ssm": 128,
                **mamba,
            }
        else:  # granitemoehybrid
            kw = {
                "num_hidden_layers": 4,
                "layer_types": ["mamba", "attention", "mamba", "attention"],
                "num_key_value_heads": 2,
                "num_local_experts": 0,
                "shared_intermediate_size": 256,
                **mamba,
            }
    return MAMBA2_HYBRID_CLASSES[family][0], {**_COMMON, **kw, **overrides}


def build_tiny_config(family: str, out_dir: Path, **overrides: Any) -> Path:
    """Write (or reuse) the ``config.json`` of a tiny Mamba2 hybrid of ``family`` (no weights, no
    tokenizer) under ``out_dir``; return its folder. For vLLM's configs and classmethods only: an
    engine loads it with ``load_format="dummy"``. Same naming and publication rules as
    ``build_tiny_model`` (a digest of the config in the folder name, atomic rename)."""
    cls_name, kwargs = mamba2_hybrid_config_kwargs(family, **overrides)
    digest = _folder_digest(
        {"family": family, "cls": cls_name, "kwargs": kwargs, "v": _CONFIG_BUILDER_VERSION}
    )
    target = Path(out_dir) / f"{family}-config-{digest}"
    if (target / "config.json").is_file():
        return target
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [MAMBA2_HYBRID_CLASSES[family][1]]

    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        _patch_config(tmp, {"torch_dtype": "bfloat16"})

    _publish(target, write)
    return target
