"""A model whose weights are not found locally falls back to its id and revision, and says so.

``model_identity`` logs ``MODEL_IDENTITY_UNRESOLVED`` naming the model and what could not be resolved;
a local folder logs nothing; ``hybridkv describe`` prints the fallback (and whether loads are on).
"""

from __future__ import annotations

import types
import uuid
from pathlib import Path
from typing import Any

from hybridkv.connector.identity import UNRESOLVED, UNRESOLVED_DETAIL, model_identity
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.ops.describe import render_text
from structlog.testing import capture_logs


def _vllm_config(model: str, revision: str | None = None) -> Any:
    """The fields of vLLM's config that ``model_identity`` reads."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            model=model,
            revision=revision,
            dtype="torch.bfloat16",
            quantization=None,
            hf_overrides=None,
            hf_text_config=None,
        ),
        load_config=types.SimpleNamespace(load_format="auto"),
    )


def test_unresolved_weights_warn_naming_the_model() -> None:
    # Not a path, and (a fresh name) in no local Hugging Face cache.
    model = f"hybridkv-tests/absent-{uuid.uuid4().hex[:8]}"
    with capture_logs() as logs:
        identity = model_identity(_vllm_config(model, revision="v2"))
    assert identity.weights == UNRESOLVED and not identity.resolved
    (line,) = [entry for entry in logs if entry["event"] == ConnectorLogEvent.MODEL_IDENTITY_UNRESOLVED]
    assert line["log_level"] == "warning"
    assert line["model"] == model and line["revision"] == "v2"
    assert line["unresolved"] == UNRESOLVED_DETAIL and "weights" in line["unresolved"]


def test_local_weights_resolve_without_a_warning(tmp_path: Path) -> None:
    folder = tmp_path / "chat"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 32)
    with capture_logs() as logs:
        identity = model_identity(_vllm_config(str(folder)))
    assert identity.resolved and identity.num_weight_files == 1
    assert [entry for entry in logs if entry["event"] == ConnectorLogEvent.MODEL_IDENTITY_UNRESOLVED] == []


def _report(**geometry: Any) -> dict[str, Any]:
    """A ``describe`` report with a model geometry (``geometry`` overrides its fields)."""
    return {
        "store": "memory://x",
        "namespace": "chat",
        "geometry": {
            "model": "org/chat",
            "namespace": "chat",
            "fingerprint": "0123456789ab",
            "key_prefix": "hkv1/chat/0123456789ab/",
            "hash_unit": 16,
            "hit_alignment": 16,
            "scheduler_block": 16,
            "tp": 1,
            "dcp": 1,
            "loads": True,
            "loads_off_reason": None,
            "weights": "feedfacefeedface",
            "weights_resolved": True,
            "weights_unresolved": None,
            "groups": [],
            **geometry,
        },
        "health": {"reachable": False, "error": "absent", "breaker_state": None},
        "usage": None,
        "entries": [],
    }


def test_describe_text_says_when_the_identity_is_unresolved_and_loads_are_off() -> None:
    text = render_text(_report())
    assert "loads      on" in text and "weights    feedfacefeedface" in text
    text = render_text(
        _report(
            weights=UNRESOLVED,
            weights_resolved=False,
            weights_unresolved=UNRESOLVED_DETAIL,
            loads=False,
            loads_off_reason="vLLM has prefix caching disabled",
        )
    )
    assert f"weights    UNRESOLVED: {UNRESOLVED_DETAIL}" in text
    assert "loads      OFF: vLLM has prefix caching disabled (saves continue)" in text
