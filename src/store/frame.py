"""The frame every stored value carries (hard rule 7), and the checksums it can use.

Layout (little-endian), written before the payload::

    offset size field
    0      4    magic            b"HKVF"
    4      1    version          1
    5      1    checksum_algo    0 = none, 1 = crc32 (zlib), 2 = xxh3 (64-bit)
    6      2    reserved         0
    8      4    key_length       bytes of the UTF-8 key that follow the fixed header
    12     8    payload_length
    20     8    checksum         of the payload under checksum_algo (0 for none)
    28     16   key_digest       blake2b-128 of the UTF-8 key
    44     K    key              the UTF-8 key itself (lets file stores list keys from hashed names)
    44+K   N    payload

A store opened with an integrity key (``integrity_key_file`` / ``integrity_key_env``, see
``hybridkv.store.integrity``) writes version 2 frames instead: the same 44 + K byte header, with three fields
changed::

    4      1    version          2
    5      1    checksum_algo    3 = BLAKE3 keyed hash (KEYED_BLAKE3_ALGO_ID; 0-2 are the checksums above)
    20     8    key_id           which secret sealed the frame (derived from it; reveals nothing of it)
    28     16   tag              BLAKE3 keyed hash, 128 bits, of header bytes 0-27, the key and the payload

Both versions have the same size for a key and payload length, so a reader of either kind gets the other's
frames to its frame check, which reports them ``CORRUPT`` and logs why: a version 1 reader (this code
without a key, or a release before version 2) does not know version 2; a keyed reader requires version 2.
A version 2 frame has no key digest: its key bytes are compared with the reader's key, and the tag covers
them.

A reader knows the key and the destination size, so it knows the exact frame size in advance: it reads the
header into its own small buffer and the payload straight into the destination, then checks everything.
Any mismatch is ``CORRUPT``; the payload is then unusable.

Checksum choice: ``xxh3`` runs faster than ``np.copyto``, so framing costs a fraction of a copy; ``crc32``
(zlib) and ``blake2b`` are many times slower (see docs/performance.md, "Figures behind design choices").
``xxh3`` needs the ``xxhash`` package; without it the default falls back to ``crc32``. The keyed hash is
BLAKE3, the fastest keyed hash measured (``hybridkv.store.integrity`` says why).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import zlib
from collections.abc import Sequence

MAGIC = b"HKVF"
VERSION = 1
#: The version of frames sealed with an integrity key (``hybridkv.store.integrity``).
KEYED_VERSION = 2
#: The ``checksum_algo`` byte of a version 2 frame: its tag is a BLAKE3 keyed hash.
KEYED_BLAKE3_ALGO_ID = 3
_FIXED = struct.Struct("<4sBBHIQQ16s")
#: The fixed part of every frame header, both versions (fields 7 and 8 are checksum and key digest in a
#: version 1 frame, key id and tag in a version 2 one).
FIXED_HEADER = _FIXED
FIXED_HEADER_SIZE = _FIXED.size
assert FIXED_HEADER_SIZE == 44, f"frame header layout changed: {FIXED_HEADER_SIZE} bytes"

try:  # Optional: the fast checksum. Imported once; absence only changes the default.
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None  # type: ignore[assignment]


class ChecksumAlgo(enum.IntEnum):
    """Payload checksum algorithms; the numeric value is what the frame stores."""

    NONE = 0
    CRC32 = 1
    XXH3 = 2

    @property
    def url_name(self) -> str:
        return self.name.lower()

    @property
    def is_available(self) -> bool:
        return self is not ChecksumAlgo.XXH3 or _xxhash is not None


def default_checksum() -> ChecksumAlgo:
    """The fastest available checksum: ``xxh3`` when ``xxhash`` is importable, else ``crc32``."""
    return ChecksumAlgo.XXH3 if _xxhash is not None else ChecksumAlgo.CRC32


def checksum_from_name(name: str) -> ChecksumAlgo:
    """Map a URL value (``xxh3``, ``crc32``, ``none``, ``auto``) to an algorithm; ``ValueError`` if unknown
    or not installed."""
    if name == "auto":
        return default_checksum()
    try:
        algo = ChecksumAlgo[name.upper()]
    except KeyError:
        raise ValueError(f"unknown checksum {name!r} (choose xxh3, crc32, none or auto)") from None
    if not algo.is_available:
        raise ValueError(f"checksum {name!r} needs the 'xxhash' package (pip install xxhash)")
    return algo


def compute_checksum(algo: ChecksumAlgo, parts: Sequence[memoryview]) -> int:
    """Checksum of the concatenation of ``parts`` (streaming: equal to hashing the joined bytes)."""
    if algo is ChecksumAlgo.XXH3:
        assert _xxhash is not None, "xxh3 selected without the xxhash package"
        if len(parts) == 1:
            return int(_xxhash.xxh3_64_intdigest(parts[0]))
        hasher = _xxhash.xxh3_64()
        for part in parts:
            hasher.update(part)
        return int(hasher.intdigest())
    if algo is ChecksumAlgo.CRC32:
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return crc
    return 0


def key_digest(key: str) -> bytes:
    """The 16-byte digest of a key, stored in every frame and used for file names."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()


def header_size(key: str) -> int:
    """Bytes of the frame header (fixed part + UTF-8 key) for ``key``."""
    return FIXED_HEADER_SIZE + len(key.encode("utf-8"))


def encode_header(key: str, algo: ChecksumAlgo, payload: Sequence[memoryview]) -> bytes:
    """The header for ``payload`` stored under ``key``; the payload itself is written after it."""
    key_bytes = key.encode("utf-8")
    payload_length = sum(part.nbytes for part in payload)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        int(algo),
        0,
        len(key_bytes),
        payload_length,
        compute_checksum(algo, payload),
        hashlib.blake2b(key_bytes, digest_size=16).digest(),
    )
    return fixed + key_bytes


def check_frame(
    key: str, header: memoryview | bytes, payload: Sequence[memoryview], *, required: ChecksumAlgo
) -> str | None:
    """Check a frame read back for ``key``: returns ``None`` if it is intact, else why it is not.

    ``required`` is the reader's configured checksum: a frame that claims no checksum is rejected when the
    reader wants one (otherwise one flipped bit in the algorithm byte would switch verification off).
    A frame written with another available checksum is verified with that one, so processes with
    different defaults still share entries.
    """
    key_bytes = key.encode("utf-8")
    if len(header) != FIXED_HEADER_SIZE + len(key_bytes):
        return f"header is {len(header)} bytes, expected {FIXED_HEADER_SIZE + len(key_bytes)}"
    magic, version, algo_id, reserved, key_length, payload_length, checksum, digest = _FIXED.unpack_from(
        header, 0
    )
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}"
    if version != VERSION:
        return (
            f"frame is sealed with an integrity key (key id {checksum:016x}) and this store has none"
            if version == KEYED_VERSION
            else f"unsupported frame version {version}"
        )
    if reserved != 0:
        return f"reserved field is {reserved}, expected 0"
    if key_length != len(key_bytes) or digest != hashlib.blake2b(key_bytes, digest_size=16).digest():
        return "frame was written under another key"
    if bytes(header[FIXED_HEADER_SIZE:]) != key_bytes:
        return "frame key bytes differ from the key"
    expected_length = sum(part.nbytes for part in payload)
    if payload_length != expected_length:
        return f"payload is {payload_length} bytes, destination holds {expected_length}"
    return _checksum_problem(algo_id, checksum, payload, required=required)


def _checksum_problem(
    algo_id: int, checksum: int, payload: Sequence[memoryview], *, required: ChecksumAlgo
) -> str | None:
    """The checksum half of ``check_frame``: ``None`` if the frame's checksum fields and ``payload`` agree
    (and satisfy the reader's ``required`` checksum), else why not."""
    try:
        algo = ChecksumAlgo(algo_id)
    except ValueError:
        return f"unknown checksum algorithm id {algo_id}"
    if algo is ChecksumAlgo.NONE:
        if required is not ChecksumAlgo.NONE:
            return f"frame has no checksum but the reader requires {required.url_name}"
        if checksum != 0:
            return "frame without checksum carries a non-zero checksum field"
        return None
    if not algo.is_available:
        return f"frame uses checksum {algo.url_name}, which is not installed here"
    actual = compute_checksum(algo, payload)
    if actual != checksum:
        return f"{algo.url_name} checksum mismatch (stored {checksum:#x}, computed {actual:#x})"
    return None


def key_from_header(header: bytes) -> str | None:
    """The key recorded in a frame header prefix (at least ``FIXED_HEADER_SIZE + key_length`` bytes), or
    ``None`` if the prefix is not a frame header. Used only for listing; reads always check the full frame.
    Both versions list: a version 2 frame has no key digest to compare, so its key is taken as written (the
    file store still requires the file name to be that key's)."""
    if len(header) < FIXED_HEADER_SIZE:
        return None
    magic, version, _algo, _reserved, key_length, _len, _sum, digest = _FIXED.unpack_from(header, 0)
    if (
        magic != MAGIC
        or version not in (VERSION, KEYED_VERSION)
        or len(header) < FIXED_HEADER_SIZE + key_length
    ):
        return None
    key_bytes = bytes(header[FIXED_HEADER_SIZE : FIXED_HEADER_SIZE + key_length])
    if version == VERSION and hashlib.blake2b(key_bytes, digest_size=16).digest() != digest:
        return None
    try:
        return key_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return None
