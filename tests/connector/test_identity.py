"""The model identity in the fingerprint, the manifest and ``hybridkv store ls`` (real files, no engine)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from hybridkv.cli import main
from hybridkv.connector.identity import (
    MANIFEST_BYTES,
    ModelIdentity,
    drafter_identity,
    encode_manifest,
    manifest,
    manifest_key,
    read_manifest,
    weights_identity,
    write_manifest,
)
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology
from hybridkv.store import Status, open_store

GEOMETRY = Geometry(groups=(GroupSpec.full(16),), topology=Topology(tp_size=1, dcp_size=1))


@pytest.fixture
def memory_url() -> str:
    return f"memory://identity-{uuid.uuid4().hex}"


def _model_folder(root: Path, weights: bytes = b"\x01" * 64) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-1.safetensors"}}')
    (root / "model-1.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")  # not a weight: never enters the identity
    return root


def _identity(**changes: object) -> ModelIdentity:
    base = ModelIdentity(
        model="/models/chat",
        revision=None,
        weights="0123456789abcdef",
        num_weight_files=1,
        dtype="torch.bfloat16",
        quantization=None,
        load_format="auto",
        hf_overrides="",
        rope_scaling="",
    )
    return dataclasses.replace(base, **changes)


def test_weights_identity_follows_the_files_not_the_path(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "a" / "chat")
    digest, num_files = weights_identity(folder)
    assert num_files == 1
    shutil.copytree(folder, tmp_path / "b" / "other-name")  # copy2 keeps file times, as cp -p / rsync -a
    assert weights_identity(tmp_path / "b" / "other-name")[0] == digest, "the path must not matter"
    (folder / "tokenizer.json").write_text('{"changed": 1}')
    assert weights_identity(folder)[0] == digest, "non-weight files must not matter"

    weight = folder / "model-1.safetensors"
    stat = weight.stat()
    weight.write_bytes(b"\x02" * 64)  # a new fine-tune of the same size, written in place
    os.utime(weight, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weights_identity(folder)[0] != digest, "rewritten weights of the same size must change it"
    os.utime(weight, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_identity(folder)[0] == digest  # same name, size and time: the documented limit
    (folder / "config.json").write_text('{"hidden_size": 8, "rope_scaling": {"factor": 2}}')
    assert weights_identity(folder)[0] != digest, "config.json content must change it"


@pytest.mark.parametrize(
    "change",
    [
        {"weights": "fedcba9876543210"},
        {"revision": "v2"},
        {"quantization": "fp8"},
        {"dtype": "torch.float16"},
        {"hf_overrides": '{"num_hidden_layers": 2}'},
        {"rope_scaling": '{"rope_scaling": {"factor": 4.0, "rope_type": "yarn"}}'},
        {"load_format": "dummy"},
        {"drafter": "eagle:0123456789abcdef"},
    ],
)
def test_every_identity_field_changes_the_fingerprint(change: dict[str, object]) -> None:
    base, changed = _identity(), _identity(**change)
    assert changed.digest != base.digest
    schemes = [
        KeyScheme(namespace="chat", model="chat", geometry=GEOMETRY, model_identity=x.digest)
        for x in (base, changed)
    ]
    assert schemes[0].fingerprint != schemes[1].fingerprint, change


def _spec_config(method: str, draft: Path | None) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` ``drafter_identity`` reads (vLLM's ``SpeculativeConfig``: ``method``,
    ``draft_model_config`` -- None for drafters without a model -- and ``uses_draft_kv_cache()``)."""
    draft_config = None if draft is None else SimpleNamespace(model=str(draft), revision=None, dtype="bf16")
    spec = SimpleNamespace(
        method=method,
        draft_model_config=draft_config,
        uses_draft_kv_cache=lambda: method not in ("ngram", "suffix"),
    )
    return SimpleNamespace(speculative_config=spec)


def test_a_drafter_with_kv_enters_the_identity_and_one_without_leaves_the_keys_alone(tmp_path: Path) -> None:
    """EAGLE's draft layer shares the target's KV-cache group, so a block's value holds the draft's pages:
    two drafters must never read each other's blocks; the same drafter in another folder shares them; an
    ngram drafter (no model, no KV) keys like no drafter at all, and an identity without a drafter digests
    as it did before drafters entered it."""
    a = _model_folder(tmp_path / "a" / "draft")
    b = _model_folder(tmp_path / "b" / "draft", weights=b"\x03" * 64)
    shutil.copytree(a, tmp_path / "c" / "same-draft")
    assert drafter_identity(SimpleNamespace(speculative_config=None)) == ""  # type: ignore[arg-type]
    assert drafter_identity(_spec_config("ngram", None)) == ""  # type: ignore[arg-type]
    # vLLM gives ngram the target's model config as its draft config: still no KV of its own.
    assert drafter_identity(_spec_config("ngram", a)) == ""  # type: ignore[arg-type]
    eagle_a = drafter_identity(_spec_config("eagle", a))  # type: ignore[arg-type]
    assert eagle_a.startswith("eagle:")
    assert drafter_identity(_spec_config("eagle", tmp_path / "c" / "same-draft")) == eagle_a  # type: ignore[arg-type]
    assert drafter_identity(_spec_config("eagle", b)) != eagle_a  # type: ignore[arg-type]
    assert drafter_identity(_spec_config("eagle3", a)) != eagle_a  # type: ignore[arg-type]
    assert _identity(drafter=eagle_a).digest != _identity().digest
    # No drafter: the digest of the fields there were before (keys of existing stores stay valid).
    legacy = dataclasses.asdict(_identity())
    legacy.pop("model"), legacy.pop("drafter")
    canonical = json.dumps(legacy, sort_keys=True, separators=(",", ":"))
    assert _identity().digest == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_same_folder_name_different_weights_never_share_keys() -> None:
    old = KeyScheme(namespace="chat", model="chat", geometry=GEOMETRY, model_identity=_identity().digest)
    new = KeyScheme(
        namespace="chat", model="chat", geometry=GEOMETRY, model_identity=_identity(weights="feed").digest
    )
    assert old.key(0, 0, b"\xab") != new.key(0, 0, b"\xab")
    moved = _identity(model="/elsewhere/chat-copy")  # same files, another folder: same identity
    assert moved.digest == _identity().digest
    assert KeyScheme(namespace="chat", model="chat-copy", geometry=GEOMETRY, model_identity=moved.digest).key(
        0, 0, b"\xab"
    ) == old.key(0, 0, b"\xab")


def test_manifest_is_one_fixed_size_value_and_first_writer_wins(memory_url: str) -> None:
    scheme = KeyScheme(namespace="chat", model="chat", geometry=GEOMETRY, model_identity=_identity().digest)
    record = manifest(scheme, _identity(), ["0:full/FullAttentionSpec span=16 layers=2"])
    store = open_store(memory_url)
    assert write_manifest(store, scheme, record) is Status.OK
    assert write_manifest(store, scheme, {**record, "model": "someone else"}) is Status.OK
    assert read_manifest(store, manifest_key(scheme)) == record
    huge = {**record, "hf_overrides": "x" * 10_000}
    assert len(encode_manifest(huge)) == MANIFEST_BYTES
    # Beside the groups' keys, never one a lookup asks for (those end in a block hash's hex).
    assert manifest_key(scheme) == f"{scheme.geometry_prefix}manifest"
    store.close()


def test_store_ls_shows_each_fingerprint_with_its_model(
    memory_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store(memory_url)
    identities = {"v1": _identity(), "v2": _identity(weights="feedfacefeedface")}
    fingerprints = {}
    for name, identity in identities.items():
        scheme = KeyScheme(namespace="chat", model="chat", geometry=GEOMETRY, model_identity=identity.digest)
        fingerprints[name] = scheme.fingerprint
        write_manifest(store, scheme, manifest(scheme, identity, []))
        store.put([scheme.key(0, 0, bytes([i])) for i in range(3)], [b"kv"] * 3)
    store.put(["hkv1/legacy/0123456789ab/g0/tp0/dcp0/00"], [b"kv"])  # written before manifests existed
    # Neither a block entry nor a manifest (another tool's keys under the prefix): no deployment's.
    store.put(["hkv1/chat/README", "hkv1/chat/0123456789ab/g0/notes"], [b"x", b"x"])
    capsys.readouterr()
    assert main(["store", "ls", memory_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    rows = {row["fingerprint"]: row for row in listed["deployments"]}
    for name, identity in identities.items():
        row = rows[fingerprints[name]]
        assert row["namespace"] == "chat" and row["num_keys"] == 3 and row["weights"] == identity.weights
    assert rows["0123456789ab"] == {"namespace": "legacy", "fingerprint": "0123456789ab", "num_keys": 1}
    assert len(rows) == 3, f"keys of no deployment were counted: {sorted(rows)}"
    assert main(["store", "ls", memory_url]) == 0
    text = capsys.readouterr().out
    assert "feedfacefeedface" in text and "0123456789abcdef" in text and fingerprints["v1"] in text
    store.close()
