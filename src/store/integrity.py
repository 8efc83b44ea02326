"""Keyed integrity: frames that only a holder of the store's secret can write (opt-in, per store URL).

A frame checksum (``hybridkv.store.frame``) catches accidents, not forgery: any client that can write to a
shared store (a Mooncake deployment, a store directory) can frame any bytes under any key, and an engine
would load them as its own KV -- wrong tokens, or planted context. A store URL with ``integrity_key_file=PATH``
or ``integrity_key_env=NAME`` seals every frame it writes with a 128-bit BLAKE3 keyed hash (a MAC) of the
frame's header fields, key and payload, under a key derived from a secret that the engines share and other
writers lack, and verifies it on every read before the bytes are used (the version 2 frame in
``hybridkv.store.frame``). A frame written without the key (every frame of a store without one: that is
the point), with another secret, another key's frame copied under this key, or a damaged one reads
``CORRUPT`` (counted in the store's ``num_corrupt_reads``, logged as ``store.corrupt_value``); the connector
then recomputes and invalidates the entry, so a planted value costs one miss. A store without a key reads
keyed frames as ``CORRUPT`` too (it cannot verify them), so the engines that share a store either all hold
its key or none does.

Secrets: the key file (or the environment variable) holds one secret per line, the current one first; every
further line is a previous secret, still accepted when reading. A secret is the line's bytes with surrounding
whitespace removed, at least ``MIN_SECRET_BYTES`` long (``openssl rand -hex 32`` writes a good one). The URL
names only where the secret is, never the secret, so the store's ``url``, its stats and its log lines carry
no secret (the URL is refused, unrepeated, if it holds ``integrity_key=...``); stats show key ids only. An
error about ``integrity_key_file`` or ``integrity_key_env`` never repeats their value, which may be a secret
typed where its location belongs (``hybridkv.store.params.SECRET_LOCATION_PARAMS``).

Key ids: each frame records which secret sealed it, an 8-byte id derived from the secret with BLAKE3's key
derivation (a separate context from the MAC key's: the id, which anyone can read, reveals nothing about the
MAC key). A reader looks the id up instead of trying every secret; an id it does not hold is ``CORRUPT``.

Rotation without downtime, with a rolling restart per step (the file is read when a store opens):
1. every engine gets ``OLD`` then ``NEW`` (it seals with OLD and accepts NEW);
2. every engine gets ``NEW`` then ``OLD`` (it seals with NEW and still accepts OLD, which the engines not yet
   restarted write);
3. once the entries sealed with OLD no longer matter, every engine gets ``NEW`` alone: OLD frames are then
   ``CORRUPT`` (one miss each, and invalidated).

Why BLAKE3: it is a keyed PRF by design (no nonce to manage, a fixed 32-byte key), releases the GIL, and on
multi-MiB payloads it ran at 6.8-8.5 GB/s on one core of the development VM against 1.75 GB/s for
HMAC-SHA256 (with SHA-NI), 0.9-1.2 GB/s for keyed BLAKE2b, 4.2-6.1 GB/s for crc32 and 30-78 GB/s for xxh3
(see docs/performance.md, "Figures behind design choices"). The ``blake3`` package is a dependency of this
package and of vLLM itself.

What it does not do: encrypt (values stay readable by whoever can read the store), stop a writer with access
from deleting or overwriting entries (a forged overwrite is a miss, not a wrong answer), or keep a secret
that leaks (rotate it out).
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Sequence

import structlog
from hybridkv.store.base import StoreLogEvent
from hybridkv.store.frame import (
    FIXED_HEADER,
    FIXED_HEADER_SIZE,
    KEYED_BLAKE3_ALGO_ID,
    KEYED_VERSION,
    MAGIC,
    VERSION,
)

log = structlog.get_logger(__name__)

try:  # A dependency, imported like xxhash: without it only keyed stores fail, naming their parameter.
    import blake3 as _blake3
except ImportError:  # pragma: no cover - depends on the environment
    _blake3 = None  # type: ignore[assignment]

#: The shortest secret accepted: 128 bits, as many as the tag has.
MIN_SECRET_BYTES = 16
#: The largest key file (or environment value) read: a few secrets need a few hundred bytes; anything bigger
#: is another file named by mistake.
MAX_KEY_SOURCE_BYTES = 64 << 10
#: Bytes of the tag a version 2 frame carries.
TAG_SIZE = 16
#: The header bytes before the tag (magic, version, algorithm, reserved, key length, payload length, key id):
#: the tag covers them, then the key and the payload.
_TAG_OFFSET = FIXED_HEADER_SIZE - TAG_SIZE
# BLAKE3 key-derivation contexts: fixed, unique to this use (a changed context would make every frame CORRUPT).
_MAC_KEY_CONTEXT = "hybridkv 2026-12-02 store frame integrity: MAC key"
_KEY_ID_CONTEXT = "hybridkv 2026-12-02 store frame integrity: key id"


class IntegrityKey:
    """One secret as frames use it: its public id, and the MAC key derived from it (never shown)."""

    __slots__ = ("_mac_key", "key_id")

    def __init__(self, secret: bytes) -> None:
        if _blake3 is None:
            raise ValueError("the keyed hash needs the 'blake3' package (pip install blake3)")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a secret of {len(secret)} bytes is too short (at least {MIN_SECRET_BYTES})")
        #: Which secret sealed a frame: the first 8 bytes of a hash of the secret, little-endian.
        self.key_id = int.from_bytes(
            _blake3.blake3(secret, derive_key_context=_KEY_ID_CONTEXT).digest(8), "little"
        )
        self._mac_key = _blake3.blake3(secret, derive_key_context=_MAC_KEY_CONTEXT).digest(32)

    @property
    def key_id_text(self) -> str:
        """The key id as logs and stats show it: 16 hex digits."""
        return f"{self.key_id:016x}"

    def tag(self, covered_header: bytes, payload: Sequence[memoryview]) -> bytes:
        """The ``TAG_SIZE``-byte keyed hash of ``covered_header`` followed by the payload parts."""
        assert _blake3 is not None, "IntegrityKey exists only where blake3 is importable"
        hasher = _blake3.blake3(covered_header, key=self._mac_key)
        for part in payload:
            hasher.update(part)
        return hasher.digest(TAG_SIZE)

    def __repr__(self) -> str:
        return f"IntegrityKey(id={self.key_id_text})"


class Keyring:
    """The secrets a store holds: the first (current) seals new frames; every one of them verifies."""

    def __init__(self, keys: Sequence[IntegrityKey]) -> None:
        if not keys:
            raise ValueError("a keyring needs at least one secret")
        self._current = keys[0]
        self._id_to_key: dict[int, IntegrityKey] = {}
        for key in keys:
            if key.key_id in self._id_to_key:
                raise ValueError(f"two secrets have the same key id {key.key_id_text}")
            self._id_to_key[key.key_id] = key

    @property
    def current(self) -> IntegrityKey:
        return self._current

    @property
    def key_ids(self) -> list[str]:
        """The ids of every secret held, the current one first (safe to show: every frame carries one)."""
        return [key.key_id_text for key in self._id_to_key.values()]

    def encode_header(self, key: str, payload: Sequence[memoryview]) -> bytes:
        """The version 2 header for ``payload`` stored under ``key``, sealed with the current secret."""
        key_bytes = key.encode("utf-8")
        payload_length = sum(part.nbytes for part in payload)
        covered = FIXED_HEADER.pack(
            MAGIC,
            KEYED_VERSION,
            KEYED_BLAKE3_ALGO_ID,
            0,
            len(key_bytes),
            payload_length,
            self._current.key_id,
            b"",
        )[:_TAG_OFFSET]
        return covered + self._current.tag(covered + key_bytes, payload) + key_bytes

    def check_frame(self, key: str, header: memoryview | bytes, payload: Sequence[memoryview]) -> str | None:
        """Check a frame read back for ``key``: ``None`` if it is intact and sealed with a secret held here,
        else why not. The cheap field checks run first; the tag is computed only for a frame that passes
        them, and compared in constant time."""
        key_bytes = key.encode("utf-8")
        problem = _keyed_fields_problem(key_bytes, header, sum(part.nbytes for part in payload))
        if problem is not None:
            return problem
        key_id, tag = FIXED_HEADER.unpack_from(header, 0)[6:]
        sealed_with = self._id_to_key.get(key_id)
        if sealed_with is None:
            return (
                f"frame is sealed with integrity key id {key_id:016x}, which this store does not hold "
                f"(it holds {', '.join(self.key_ids)})"
            )
        expected_tag = sealed_with.tag(bytes(header[:_TAG_OFFSET]) + key_bytes, payload)
        if not hmac.compare_digest(expected_tag, tag):
            return f"integrity tag mismatch under key id {key_id:016x}: the frame is forged or damaged"
        return None

    def __repr__(self) -> str:
        return f"Keyring(key_ids={self.key_ids})"


def _keyed_fields_problem(key_bytes: bytes, header: memoryview | bytes, payload_length: int) -> str | None:
    """Why ``header`` is not a version 2 header for ``key_bytes`` and ``payload_length`` bytes of payload,
    or ``None``: every field but the key id and the tag."""
    if len(header) != FIXED_HEADER_SIZE + len(key_bytes):
        return f"header is {len(header)} bytes, expected {FIXED_HEADER_SIZE + len(key_bytes)}"
    magic, version, algo_id, reserved, key_length, stored_length, _key_id, _tag = FIXED_HEADER.unpack_from(
        header, 0
    )
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}"
    if version != KEYED_VERSION:
        return (
            "frame is not sealed with an integrity key (written by a store without one)"
            if version == VERSION
            else f"unsupported frame version {version}"
        )
    if algo_id != KEYED_BLAKE3_ALGO_ID:
        return f"unknown keyed hash algorithm id {algo_id}"
    if reserved != 0:
        return f"reserved field is {reserved}, expected 0"
    if key_length != len(key_bytes) or bytes(header[FIXED_HEADER_SIZE:]) != key_bytes:
        return "frame was written under another key"
    if stored_length != payload_length:
        return f"payload is {stored_length} bytes, destination holds {payload_length}"
    return None


def keyring_from_text(text: bytes) -> Keyring:
    """The keyring a key file's (or environment value's) bytes hold: one secret per non-blank line, the
    current one first. Raises ``ValueError`` saying what is wrong; the message never quotes a secret."""
    if len(text) > MAX_KEY_SOURCE_BYTES:
        raise ValueError(f"it holds {len(text)} bytes, more than a key file's {MAX_KEY_SOURCE_BYTES}")
    keys: list[IntegrityKey] = []
    key_id_to_line: dict[int, int] = {}
    for line_number, line in enumerate(text.split(b"\n"), start=1):
        secret = line.strip()
        if not secret:
            continue
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"its line {line_number} holds a secret of {len(secret)} bytes; each needs at least "
                f"{MIN_SECRET_BYTES} (e.g. the 64 hex digits of `openssl rand -hex 32`)"
            )
        key = IntegrityKey(secret)
        if key.key_id in key_id_to_line:
            raise ValueError(
                f"its line {line_number} repeats the secret of line {key_id_to_line[key.key_id]}"
            )
        key_id_to_line[key.key_id] = line_number
        keys.append(key)
    if not keys:
        raise ValueError("it holds no secret (it is empty or blank)")
    return Keyring(keys)


def keyring_from_file(path: str, *, warn_if_shared: bool = True) -> Keyring:
    """The keyring key file ``path`` holds (see ``keyring_from_text``). Raises ``ValueError`` saying what is
    wrong: a relative path, a missing, unreadable or non-regular file, or bad contents. With
    ``warn_if_shared``, a file that others than its owner may read or write is logged (it still opens)."""
    if not os.path.isabs(path):
        raise ValueError("it must be an absolute path (engines and tools start in different folders)")
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("it is not a regular file")
        with open(path, "rb") as file:
            text = file.read(MAX_KEY_SOURCE_BYTES + 1)
    except FileNotFoundError:
        raise ValueError("it does not exist") from None
    except OSError as error:
        raise ValueError(f"it cannot be read: {error.strerror or error}") from None
    keyring = keyring_from_text(text)
    if warn_if_shared and info.st_mode & 0o077:  # whoever can read the secret can forge values
        log.warning(StoreLogEvent.INTEGRITY_KEY_FILE_NOT_PRIVATE, path=path, mode=f"{info.st_mode & 0o777:o}")
    return keyring


def keyring_from_environment(name: str) -> Keyring:
    """The keyring environment variable ``name`` holds (see ``keyring_from_text``). Raises ``ValueError``
    saying what is wrong: no name, an unset variable, or bad contents. The message never quotes ``name``:
    it may be a secret typed where the variable's name belongs."""
    if not name:
        raise ValueError("it names no environment variable")
    value = os.environ.get(name)
    if value is None:
        raise ValueError("the environment variable it names is not set")
    return keyring_from_text(os.fsencode(value))
