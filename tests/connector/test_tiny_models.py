"""The tiny-model builder: deterministic, cached by config digest, vLLM-readable configs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import (
    FAMILIES,
    SIZES,
    _digest,
    build_tiny_model,
    size_overrides,
    tiny_config_kwargs,
)


def test_build_is_cached_and_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model("llama", tmp_path)
    t0 = time.monotonic()
    b = build_tiny_model("llama", tmp_path)
    assert a == b and time.monotonic() - t0 < 0.5, "a repeat build must reuse the folder"
    other = build_tiny_model("llama", tmp_path / "other")
    assert (a / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes(), "fixed seed"
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    c = build_tiny_model("llama", tmp_path, num_key_value_heads=1)
    assert c != a, "another config is another folder"


def test_tokenizer_spells_every_id_and_renders_the_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = build_tiny_model("llama", tmp_path)
    weights = (model / "model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size, "every id the model can sample must decode"
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "Hello, cache! 123"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"

    # A folder built before tokenizers existed gets them on the next build call; the weights stay.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink()
    assert build_tiny_model("llama", tmp_path) == model
    assert (model / "tokenizer_config.json").is_file()
    assert (model / "model.safetensors").read_bytes() == weights


def test_lfm2_keeps_the_keys_vllm_reads(tmp_path: Path) -> None:
    cfg = json.loads((build_tiny_model("lfm2", tmp_path) / "config.json").read_text())
    assert cfg["conv_dim"] == 128 and cfg["block_dim"] == 128


def test_families_and_unknown_family() -> None:
    assert set(FAMILIES) == {"llama", "gemma3", "qwen3_next", "lfm2"}
    assert tiny_config_kwargs("qwen3_next")[1]["linear_key_head_dim"] == 128  # the CPU GDN kernel needs 128
    with pytest.raises(ValueError, match="mamba2"):
        tiny_config_kwargs("mamba2")


def test_sizes_only_add_overrides_and_long_is_tiny_with_32k_positions() -> None:
    assert SIZES == ("tiny", "bench", "long")
    for family in FAMILIES:
        cls, tiny = tiny_config_kwargs(family)
        assert size_overrides(family, "tiny") == {}
        long_cls, long = tiny_config_kwargs(family, size="long")
        assert long_cls == cls and long == tiny | {"max_position_embeddings": 32768}, family
        assert tiny["max_position_embeddings"] == 4096
        # Another config is another folder name (the digest covers the kwargs): a long model never reuses a
        # tiny folder.
        assert _digest(family, cls, long, 0) != _digest(family, cls, tiny, 0)
        # Overrides still win over the size's.
        assert tiny_config_kwargs(family, size="long", max_position_embeddings=8192)[1] == tiny | {
            "max_position_embeddings": 8192
        }
    with pytest.raises(ValueError, match="unknown model size"):
        size_overrides("llama", "huge")
    with pytest.raises(ValueError, match="unknown tiny model family"):
        size_overrides("mamba2", "long")


def test_bench_clis_take_every_size() -> None:
    from hybridkv.cli import build_parser

    parser = build_parser()
    for size in SIZES:
        assert parser.parse_args(["bench", "serve", "--size", size]).size == size
        assert parser.parse_args(["bench", "ttft", "--size", size]).size == size
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--size", "huge"])
