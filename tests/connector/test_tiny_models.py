"""The tiny-model builder: deterministic, cached by config digest, vLLM-readable configs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hybridkv.testing.tiny_models import FAMILIES, build_tiny_model, tiny_config_kwargs


def test_build_is_cached_and_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model("llama", tmp_path)
    t0 = time.monotonic()
    b = build_tiny_model("llama", tmp_path)
    assert a == b and time.monotonic() - t0 < 0.5, "a repeat build must reuse the folder"
    other = build_tiny_model("llama", tmp_path / "other")
    assert (a / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes(), "fixed seed"
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert not list(a.glob("tokenizer*")), "no tokenizer: engines run with skip_tokenizer_init"
    c = build_tiny_model("llama", tmp_path, num_key_value_heads=1)
    assert c != a, "another config is another folder"


def test_lfm2_keeps_the_keys_vllm_reads(tmp_path: Path) -> None:
    cfg = json.loads((build_tiny_model("lfm2", tmp_path) / "config.json").read_text())
    assert cfg["conv_dim"] == 128 and cfg["block_dim"] == 128


def test_families_and_unknown_family() -> None:
    assert set(FAMILIES) == {"llama", "gemma3", "qwen3_next", "lfm2"}
    assert tiny_config_kwargs("qwen3_next")[1]["linear_key_head_dim"] == 128  # the CPU GDN kernel needs 128
    with pytest.raises(ValueError, match="mamba2"):
        tiny_config_kwargs("mamba2")
