"""Keys carry the model's identity, not its folder name; ``cache_salt`` isolates requests.

Real vLLM (CPU build) engines on a tiny random-weight Llama and a real ``file://`` store, with the default
connector configuration (only the store URL set).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv.demo.tiny_models import build_tiny_model
from support.engines import MODELS_DIR, connectors, engine, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT_LEN = 300  # two full 128-token blocks + a tail


def _install(weights: Path, folder: Path) -> None:
    """Put ``weights``' files into ``folder``, replacing what is there (file times are kept, as ``cp -p``)."""
    shutil.copytree(weights, folder, dirs_exist_ok=True)


def test_weights_replaced_in_place_never_read_the_old_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same folder name, new weights: no external hit from the old weights' entries; a copy of the new
    weights in another folder hits them (the identity is the files, not the path); ``store ls`` tells the
    two fingerprints apart by their weights."""
    old_weights = build_tiny_model("llama", MODELS_DIR, seed=0)
    new_weights = build_tiny_model("llama", MODELS_DIR, seed=1)
    folder = tmp_path / "models" / "chat"
    url = f"file://{tmp_path}/store?capacity=256MiB"
    extra = {"store": url}
    tokens = prompt(PROMPT_LEN, seed=31)

    _install(old_weights, folder)
    with engine(folder, extra) as llm:
        generate(llm, tokens)
        old_fingerprint = connectors(llm)[0].scheduler_side.scheme.fingerprint
    _install(new_weights, folder)  # a new fine-tune written over the old one
    with engine(folder, extra) as llm:
        new_out, cached_new = generate(llm, tokens)
        new_fingerprint = connectors(llm)[0].scheduler_side.scheme.fingerprint
    assert cached_new == 0, f"new weights took {cached_new} tokens of KV computed by the old weights"
    assert new_fingerprint != old_fingerprint

    _install(new_weights, tmp_path / "elsewhere" / "chat-copy")
    with engine(tmp_path / "elsewhere" / "chat-copy", {**extra, "namespace": "chat"}) as llm:
        copy_out, cached_copy = generate(llm, tokens)
        copy_fingerprint = connectors(llm)[0].scheduler_side.scheme.fingerprint
    assert copy_fingerprint == new_fingerprint and cached_copy == 256 and copy_out == new_out

    capsys.readouterr()
    assert main(["store", "ls", url, "--json"]) == 0
    deployments = {d["fingerprint"]: d for d in json.loads(capsys.readouterr().out)["deployments"]}
    assert set(deployments) == {old_fingerprint, new_fingerprint}, deployments
    old, new = deployments[old_fingerprint], deployments[new_fingerprint]
    assert old["namespace"] == new["namespace"] == "chat"
    assert old["weights"] != new["weights"] and old["num_weight_files"] == new["num_weight_files"] == 1
    assert old["num_keys"] > 0 and new["num_keys"] > 0 and old["dtype"] == "torch.bfloat16"
    assert main(["store", "ls", url]) == 0
    table = capsys.readouterr().out
    assert old["weights"] in table and new["weights"] in table and "fingerprint" in table


def test_cache_salt_isolates_requests(tmp_path: Path) -> None:
    """A resend with another ``cache_salt`` gets no external hit; with the same salt it hits."""
    model = build_tiny_model("llama", MODELS_DIR)
    tokens = prompt(PROMPT_LEN, seed=41)
    with engine(model, {"store": f"file://{tmp_path}/store?capacity=256MiB"}) as llm:
        cold, _ = generate(llm, tokens, cache_salt="tenant-a")
        reset_local_cache(llm)
        _, cached_other_salt = generate(llm, tokens, cache_salt="tenant-b")
        reset_local_cache(llm)
        _, cached_no_salt = generate(llm, tokens)
        reset_local_cache(llm)
        warm, cached_same_salt = generate(llm, tokens, cache_salt="tenant-a")
    assert cached_other_salt == 0, f"tenant-b read {cached_other_salt} tokens of tenant-a's KV"
    assert cached_no_salt == 0, f"an unsalted request read {cached_no_salt} tokens of tenant-a's KV"
    assert cached_same_salt == 256 and warm == cold
