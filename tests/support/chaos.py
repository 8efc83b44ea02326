"""Values derived from their keys, the writer child the chaos tests kill, and a fresh-process verifier
(``tests/store/test_chaos_in_transfers.py``).

Every key names its payload size (``PREFIX/N/SIZE``) and its bytes are a function of the key alone
(:func:`value_parts`): slices of one seeded random pool, at offsets drawn from the key's digest. Any process
can therefore say what the value under a key must be, bit for bit, without having seen the put -- which is
what lets the tests check what a killed writer left behind. The parts are views (no copy), so a writer
spends its time in the store's put, where the kills are meant to land.

``python -m support.chaos write URL PREFIX PROGRESS [--sizes N,...] [--batch N]`` puts batches of new keys
until killed and appends one line per event to the ``PROGRESS`` file (``O_APPEND`` writes, one line each)::

    ready PID                  once the store is open (PID: the writer's, also under a tracer)
    begin KEY KEY ...          before each put (the batch in flight)
    done KEY=STATUS ...        after it

``python -m support.chaos verify URL KEYS_JSON`` opens the store in a new process and prints one JSON line
with :func:`verify_keys`'s counts over the keys listed in ``KEYS_JSON``, plus every key the store lists.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from hybridkv.store import Status, Store, open_store

#: The pool every value is sliced from: 4 MiB of seeded random bytes (~20 ms to generate).
_POOL_BYTES = 4 << 20
_POOL_SEED = 20261202
#: A value is parts of at most this many bytes (like one KV layer each), each a slice of the pool.
PART_BYTES = 1 << 20
_pool: np.ndarray | None = None


def _the_pool() -> np.ndarray:
    global _pool  # noqa: PLW0603 -- generated once per process, on first use
    if _pool is None:
        _pool = np.frombuffer(np.random.default_rng(_POOL_SEED).bytes(_POOL_BYTES), dtype=np.uint8)
    return _pool


def chaos_key(prefix: str, index: int, size: int) -> str:
    """The key of the ``index``-th value of ``prefix``, ``size`` payload bytes."""
    return f"{prefix}/{index}/{size}"


def size_of(key: str) -> int:
    """The payload size a :func:`chaos_key` names."""
    return int(key.rsplit("/", 1)[1])


def value_parts(key: str) -> list[np.ndarray]:
    """The payload under ``key``: read-only views into the pool, ``PART_BYTES`` each but the last, at
    offsets drawn from the key's digest (so two keys' values differ)."""
    pool = _the_pool()
    size = size_of(key)
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    parts: list[np.ndarray] = []
    for start in range(0, size, PART_BYTES):
        length = min(PART_BYTES, size - start)
        offset = int(rng.integers(0, _POOL_BYTES - length + 1))
        parts.append(pool[offset : offset + length])
    return parts


def first_mismatch(key: str, payload: np.ndarray) -> int:
    """Where ``payload`` (a uint8 array of ``size_of(key)`` bytes) first differs from ``key``'s value;
    ``size_of(key)`` if it does not."""
    start = 0
    for part in value_parts(key):
        chunk = payload[start : start + part.size]
        differs = np.flatnonzero(chunk != part)
        if differs.size:
            return start + int(differs[0])
        start += part.size
    return start


def read_outcomes(store: Store, keys: Sequence[str]) -> list[str]:
    """``exists`` then ``get_into`` of every key; one outcome per key: ``exact`` (exists OK, read OK with the
    key's bytes), ``not_found`` (both NOT_FOUND), or a wrong one: ``wrong_bytes`` (read OK with other
    bytes), ``exists_disagrees`` (exists and read disagree), ``get_STATUS`` for any other read status
    (``get_corrupt``, ``get_transfer_failed``...)."""
    if not keys:
        return []
    destinations = [np.zeros(size_of(key), dtype=np.uint8) for key in keys]
    exists = store.exists(keys)
    reads = store.get_into(keys, destinations)
    outcomes: list[str] = []
    for key, exists_status, read_status, destination in zip(keys, exists, reads, destinations, strict=True):
        if read_status is Status.OK and first_mismatch(key, destination) != size_of(key):
            outcomes.append("wrong_bytes")
        elif read_status not in (Status.OK, Status.NOT_FOUND):
            outcomes.append(f"get_{read_status.value}")
        elif exists_status is not read_status:
            outcomes.append("exists_disagrees")
        else:
            outcomes.append("exact" if read_status is Status.OK else "not_found")
    return outcomes


def verify_keys(store: Store, keys: Sequence[str]) -> Counter[str]:
    """How many keys had each :func:`read_outcomes` outcome. Call it while nothing writes the keys."""
    return Counter(read_outcomes(store, keys))


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent exits (``prctl(PR_SET_PDEATHSIG)``): a test
    killed mid-round, or a tracer that exits, leaves no writer behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _write(url: str, prefix: str, progress: Path, sizes: Sequence[int], batch: int) -> int:
    """Put batches of new keys into ``url`` until killed (see the module docstring)."""
    _die_with_parent()
    store = open_store(url)
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _the_pool()

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    note(f"ready {os.getpid()}")
    index = 0
    while True:
        keys = [chaos_key(prefix, index + j, sizes[(index + j) % len(sizes)]) for j in range(batch)]
        index += batch
        note("begin " + " ".join(keys))
        statuses = store.put(keys, [value_parts(key) for key in keys])
        note("done " + " ".join(f"{key}={status.value}" for key, status in zip(keys, statuses, strict=True)))


def _verify(url: str, keys_file: Path) -> int:
    """Print the counts of :func:`verify_keys` over the listed keys, and how the store's own listing reads."""
    keys: list[str] = json.loads(keys_file.read_text())
    store = open_store(url)
    try:
        counts = verify_keys(store, keys)
        listed = sorted(store.iter_keys())
        listed_counts = verify_keys(store, listed)
    finally:
        store.close()
    print(
        json.dumps(
            {
                "keys": dict(counts),
                "listed": dict(listed_counts),
                "listed_unknown": sorted(set(listed) - set(keys)),
            }
        ),
        flush=True,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m support.chaos")
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="put batches of new keys until killed")
    write.add_argument("url")
    write.add_argument("prefix")
    write.add_argument("progress", type=Path)
    write.add_argument(
        "--sizes", default=f"{8 << 20}", help="payload sizes to cycle through, comma-separated"
    )
    write.add_argument("--batch", type=int, default=2, help="keys per put")
    verify = commands.add_parser("verify", help="read the listed keys from a fresh process")
    verify.add_argument("url")
    verify.add_argument("keys_file", type=Path)
    args = parser.parse_args(argv)
    if args.command == "write":
        sizes = [int(size) for size in args.sizes.split(",")]
        return _write(args.url, args.prefix, args.progress, sizes, args.batch)
    return _verify(args.url, args.keys_file)


if __name__ == "__main__":
    sys.exit(main())
