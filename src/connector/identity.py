"""The model's identity in the key fingerprint, and the manifest that names it in the store.

Keys must not be shared by engines whose KV differs for the same tokens. Beyond the geometry (dtypes, block
layout, TP/DCP), what makes KV differ is **which weights** are loaded and **how the model is configured**:

- the weights: for a local folder, every weight file's name (relative), size and ``st_mtime_ns``, plus the
  bytes of ``config.json`` and of the weight index files; a Hugging Face cache snapshot (``.../snapshots/<commit>``)
  is identified by its commit and its files' names and sizes instead (hosts download at different times);
  a model that is not a local folder or file is identified by its id and vLLM's ``revision``;
- quantization, ``hf_overrides``, RoPE scaling, the model dtype and the weight ``load_format``;
- the drafter of speculative decoding, when it has KV of its own (EAGLE, EAGLE3, MTP, a draft model: vLLM
  puts its attention layers in the target's KV-cache groups, so a block's value holds the draft layers'
  pages too): its method, its weights (identified like the target's) and dtype. ``ngram`` and other
  drafters without a model add nothing, so their keys are the plain target's.

When the weights cannot be found without the network (not a local folder or file, not in the local Hugging
Face cache: another hub, a custom loader), the identity falls back to the model id and ``revision``, with
``weights="unresolved"``, and :func:`model_identity` logs ``ConnectorLogEvent.MODEL_IDENTITY_UNRESOLVED``
naming the model: new weights published under the same id and revision would then share keys with the old.

It is path-insensitive: the same files in two folders are the same model, two models in folders of one
name are not. Stat calls and a few small reads: cheap at start. Not covered (each either changes vLLM's
block hashes, hence the keys, or is documented in docs/keys.md): ``cache_salt``, LoRA adapters (their name
enters vLLM's block hashes), and weights changed inside a running engine (use ``reset_cache``).

After a connector reset the checkpoint no longer names the weights (the reset may follow an in-engine
update, or not): :func:`weights_after_reset` decides the weights tag the keys carry from then on. A tag shared
between engines names the weights they hold (the operator's ``weights_version_file``), never a local count;
when the engine cannot know its weights, the tag is private to it (a fresh nonce).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.lifecycle.keys import KEY_VERSION, NAMESPACE_RE, KeyScheme
from hybridkv.store import Status, Store

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger(__name__)

#: Files whose bytes are weights (their size and mtime enter the identity; they are never read).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
#: Small files whose content enters the identity: the architecture and the weight index.
_CONFIG_NAMES = ("config.json", "params.json")
#: ``ModelIdentity.weights`` of a model whose weights were not found locally.
UNRESOLVED = "unresolved"
#: What an unresolved identity could not resolve, and what that costs (log lines, ``hybridkv describe``).
UNRESOLVED_DETAIL = (
    "weights: not a local folder or file and not in the local Hugging Face cache; new weights under the "
    "same model id and revision are not told apart"
)
#: The longest a reset waits to read ``weights_version_file`` (a hung mount names no weights: private keys).
WEIGHTS_FILE_TIMEOUT_S = 1.0
#: The most bytes of ``weights_version_file`` read (a name is at most 64 characters).
_WEIGHTS_FILE_MAX_BYTES = 4096
#: ``weights_source`` of a tag: the checkpoint alone, the ``weights_version`` key, the operator's file, or
#: private to this engine (its weights after a reset are unknown).
WEIGHTS_SOURCES = ("checkpoint", "declared", "file", "private")
_SNAPSHOT_RE = re.compile(r"/snapshots/([0-9a-f]{40})/?$")
#: The manifest is one fixed-size value (JSON padded with spaces), so a reader knows its length.
MANIFEST_BYTES = 4096
MANIFEST_NAME = "manifest"
_MANIFEST_KEY_RE = re.compile(
    rf"^{KEY_VERSION}/(?P<namespace>[^/]+)/(?P<fingerprint>[0-9a-f]{{12}})/{MANIFEST_NAME}$"
)


@dataclass(frozen=True)
class ModelIdentity:
    """What makes this deployment's KV what it is, beyond the geometry. ``digest`` enters the fingerprint."""

    model: str
    revision: str | None
    weights: str
    num_weight_files: int
    dtype: str
    quantization: str | None
    load_format: str
    hf_overrides: str
    rope_scaling: str
    #: the drafter's identity (``drafter_identity``); empty without a drafter that has KV
    drafter: str = ""

    @property
    def resolved(self) -> bool:
        """Whether the weights were found (their files identify the model, not only its id)."""
        return self.weights != UNRESOLVED

    @property
    def digest(self) -> str:
        """SHA-256 (hex, 16 digits) of every field but ``model`` for a local folder (path-insensitive)."""
        fields = asdict(self)
        if self.weights != UNRESOLVED:
            fields.pop("model")
        if not self.drafter:
            fields.pop("drafter")  # engines without a drafter keep the keys they always had
        return _short_digest(fields)


def _short_digest(fields: Mapping[str, Any]) -> str:
    """SHA-256 (hex, 16 digits) of ``fields`` as canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _canonical(value: Any) -> str:
    """A stable text for a config value (dicts sorted; a callable by its qualified name)."""
    if value is None:
        return ""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return json.dumps(value, sort_keys=True, default=str)


def weights_identity(model_path: Path) -> tuple[str, int]:
    """(digest, number of weight files) of the weights at ``model_path`` (a folder or one file)."""
    digest = hashlib.sha256()
    snapshot = _SNAPSHOT_RE.search(str(model_path))
    if model_path.is_file():
        files = [model_path]
        root = model_path.parent
    else:
        files = sorted(p for p in model_path.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
        root = model_path
    if snapshot:
        digest.update(f"snapshot {snapshot.group(1)}\n".encode())
    for path in files:
        stat = path.stat()  # follows the snapshot's symlinks to the blobs
        mtime = "" if snapshot else f" {stat.st_mtime_ns}"
        digest.update(f"{path.relative_to(root).as_posix()} {stat.st_size}{mtime}\n".encode())
    if model_path.is_dir():
        small = [model_path / n for n in _CONFIG_NAMES] + sorted(model_path.glob("*.index.json"))
        for path in small:
            if path.is_file():
                digest.update(f"{path.name}\n".encode() + path.read_bytes() + b"\n")
    return digest.hexdigest()[:16], len(files)


def _local_model_path(model: str, revision: str | None) -> Path | None:
    """The folder or file vLLM loaded ``model`` from, or None if it cannot be found without the network."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 -- not in the local hub cache (or another hub): identity falls back to the id
        return None


def drafter_identity(vllm_config: VllmConfig) -> str:
    """The speculative drafter's part of the identity: ``""`` without a drafter that has KV of its own (no
    speculative decoding, ``ngram``, ``suffix``: vLLM's ``uses_draft_kv_cache()`` is False), else ``<method>:<digest>`` over its method, weights (as
    :func:`weights_identity`, or its id and revision when not local) and dtype. MTP's drafter is the
    target's own MTP layers: its weights are the target's, its method still tells it apart."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    uses_draft_kv = getattr(spec, "uses_draft_kv_cache", None)  # vLLM 0.32 and 0.33 have it
    draft = getattr(spec, "draft_model_config", None)
    if not callable(uses_draft_kv) or not uses_draft_kv() or draft is None:
        return ""  # ngram, suffix, ...: the draft model config (if any) is the target's, and no KV of its own
    method = str(spec.method)
    model = str(draft.model)
    revision = getattr(draft, "revision", None)
    path = _local_model_path(model, revision)
    weights = weights_identity(path)[0] if path is not None else f"{model}@{revision}"
    return f"{method}:{_short_digest({'method': method, 'weights': weights, 'dtype': str(getattr(draft, 'dtype', ''))})}"


def model_identity(vllm_config: VllmConfig) -> ModelIdentity:
    """Resolve the identity of the model ``vllm_config`` serves (stat calls and small reads only).

    Weights not found locally: ``weights="unresolved"`` and a ``MODEL_IDENTITY_UNRESOLVED`` warning."""
    mc = vllm_config.model_config
    model = str(mc.model)
    revision = getattr(mc, "revision", None)
    path = _local_model_path(model, revision)
    if path is None:
        weights, num_files = UNRESOLVED, 0
        # The keys still work, but weaker: an operator must know the weights do not enter them.
        log.warning(
            ConnectorLogEvent.MODEL_IDENTITY_UNRESOLVED,
            model=model,
            revision=revision,
            unresolved=UNRESOLVED_DETAIL,
        )
    else:
        weights, num_files = weights_identity(path)
    text_config = mc.hf_text_config if hasattr(mc, "hf_text_config") else None
    rope = {
        name: getattr(text_config, name, None)
        for name in ("rope_scaling", "rope_theta", "rope_parameters")
        if getattr(text_config, name, None) is not None
    }
    load_config = getattr(vllm_config, "load_config", None)
    return ModelIdentity(
        model=model,
        revision=None if revision is None else str(revision),
        weights=weights,
        num_weight_files=num_files,
        dtype=str(mc.dtype),
        quantization=None if mc.quantization is None else str(mc.quantization),
        load_format=str(getattr(load_config, "load_format", "auto")),
        hf_overrides=_canonical(getattr(mc, "hf_overrides", None)),
        rope_scaling=_canonical(rope),
        drafter=drafter_identity(vllm_config),
    )


def manifest_key(scheme: KeyScheme) -> str:
    """Where a deployment's manifest lives: next to its groups, never a block-hash key (so never looked up)."""
    return f"{scheme.geometry_prefix}{MANIFEST_NAME}"


def parse_manifest_key(key: str) -> tuple[str, str] | None:
    """``(namespace, fingerprint)`` of a deployment's manifest key (the inverse of :func:`manifest_key`);
    None for any other key (a block entry, another tool's key)."""
    match = _MANIFEST_KEY_RE.match(key)
    return None if match is None else (match["namespace"], match["fingerprint"])


def manifest(scheme: KeyScheme, identity: ModelIdentity, groups: list[str]) -> dict[str, Any]:
    """The human-readable record of a fingerprint: what model and geometry its entries belong to."""
    geometry = scheme.geometry
    return {
        "namespace": scheme.namespace,
        "fingerprint": scheme.fingerprint,
        "model": identity.model,
        "revision": identity.revision,
        "weights": identity.weights,
        "num_weight_files": identity.num_weight_files,
        "dtype": identity.dtype,
        "kv_cache_dtype": scheme.kv_cache_dtype,
        "quantization": identity.quantization,
        "load_format": identity.load_format,
        "hf_overrides": identity.hf_overrides,
        "rope_scaling": identity.rope_scaling,
        "drafter": identity.drafter,
        "hash_algorithm": scheme.hash_algorithm,
        "tp": geometry.topology.tp_size,
        "dcp": geometry.topology.dcp_size,
        "groups": groups,
    }


def encode_manifest(record: Mapping[str, Any]) -> bytes:
    """``record`` as JSON padded to ``MANIFEST_BYTES``; long free-text fields are shortened to fit."""
    fields = dict(record)
    text = json.dumps(fields, sort_keys=True)
    for name in ("hf_overrides", "rope_scaling", "groups", "model"):
        if len(text.encode()) <= MANIFEST_BYTES:
            break
        fields[name] = str(fields[name])[:200] + "..."
        text = json.dumps(fields, sort_keys=True)
    data = text.encode()
    assert len(data) <= MANIFEST_BYTES, f"manifest of {fields.get('fingerprint')} is {len(data)} bytes"
    return data.ljust(MANIFEST_BYTES, b" ")


def write_manifest(store: Store, scheme: KeyScheme, record: Mapping[str, Any]) -> Status:
    """Insert the manifest unless one is there (first writer wins; it describes the same fingerprint)."""
    return store.put([manifest_key(scheme)], [encode_manifest(record)])[0]


def read_manifest(store: Store, key: str) -> dict[str, Any] | None:
    """The manifest stored under ``key``, or None if absent or unreadable."""
    buffer = bytearray(MANIFEST_BYTES)
    if store.get_into([key], [buffer])[0] is not Status.OK:
        return None
    try:
        record: dict[str, Any] = json.loads(bytes(buffer).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record


@dataclass(frozen=True)
class WeightsTag:
    """The weights tag the keys carry after a reset, and why."""

    #: the tag (``KeyScheme.weights_tag``)
    tag: str
    #: one of ``WEIGHTS_SOURCES``
    source: str
    #: why (the audit's ``weights_rotated`` record and the log line carry it)
    reason: str


def read_weights_version(path: str, *, timeout_s: float = WEIGHTS_FILE_TIMEOUT_S) -> tuple[str | None, str]:
    """``(name, why)``: the weights name in the file at ``path`` (its first line, stripped), or None and why
    not (missing, unreadable, not a valid name, or not read within ``timeout_s``: the read runs on a thread
    of its own, so a hung mount costs the caller ``timeout_s`` at most)."""
    result: list[tuple[str | None, str]] = []

    def read() -> None:
        try:
            with open(path, "rb") as file:
                data = file.read(_WEIGHTS_FILE_MAX_BYTES)
        except OSError as error:
            result.append((None, f"weights_version_file unreadable: {error.strerror or error}"))
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            result.append((None, "weights_version_file is not UTF-8"))
            return
        lines = text.strip().splitlines()
        name = lines[0].strip() if lines else ""
        if not NAMESPACE_RE.fullmatch(name):
            result.append((None, f"weights_version_file holds no valid name ({name[:80]!r})"))
            return
        result.append((name, "weights_version_file"))

    thread = threading.Thread(target=read, name="hybridkv-weights-version", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return None, f"weights_version_file not read within {timeout_s:g} s"
    return result[0]


def weights_after_reset(current_tag: str, version_file: str | None) -> WeightsTag:
    """The weights tag of an engine's keys after a connector reset.

    vLLM resets the connector on weight updates and on much else (``pause_generation(clear_cache=True)``,
    ``sleep``, ``release_kv_cache_memory``, even after its own reset failed), so a reset says nothing about
    which weights the engine holds. With ``version_file`` the operator names them: that name is the tag
    (``current_tag`` unchanged: the keys stay). Without one, or when it cannot be read: a fresh nonce, keys
    private to this engine until its restart. Never a count of resets: two engines with one tag hold the
    weights the tag names."""
    if version_file is not None:
        name, why = read_weights_version(version_file)
        if name is not None:
            reason = "unchanged" if name == current_tag else "named by weights_version_file"
            return WeightsTag(name, "file", reason)
    else:
        why = "no weights_version_file: the weights after a reset are unknown"
    return WeightsTag(f"private-{uuid.uuid4().hex[:16]}", "private", why)


def start_scheme(scheme: KeyScheme, weights_version: str) -> KeyScheme:
    """The key scheme an engine starts with: the checkpoint's, tagged ``weights_version`` when declared.
    Both halves use it, so the scheduler's and every worker's geometry log lines show the same fingerprint."""
    return scheme.with_weights_tag(weights_version) if weights_version else scheme
