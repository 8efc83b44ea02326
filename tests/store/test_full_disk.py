"""A ``file://`` store on a file system far smaller than its capacity recovers from a full disk (issue 37).

A child process gets a private mount namespace (``unshare --mount``) with an 8 MiB tmpfs and opens a file store
of ``capacity=1GiB`` on it, so the file system, not the configured capacity, runs out. What must hold:

- puts keep succeeding after the file system filled: the store evicts the least recently used entries to
  stay within what the file system holds, and when another writer takes the space first a put that meets
  ``ENOSPC`` evicts and is retried; the newest entries read back byte-exact;
- the effective capacity (``stats().extra``) drops to about the tmpfs size, logged once with the numbers;
- with the file system filled by another writer and nothing of the store's left to evict, a put answers
  ``NO_SPACE`` and ``hybridkv describe`` exits 1 (the store cannot write); once the space is back, puts
  succeed and ``describe`` exits 0 again.
"""

from __future__ import annotations

from pathlib import Path

from support.tmpfs import run_on_private_tmpfs

_TMPFS_BYTES = 8 << 20
_VALUE_BYTES = 192 << 10  # below RECYCLE_MIN_SIZE: removed entries leave no spares to write into
_NUM_VALUES = 80  # 15 MiB: about twice the file system

_CHILD = r"""
import json, os, subprocess, sys
import structlog
from structlog.testing import capture_logs

root, tmpfs_bytes, value_bytes, num_values = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from hybridkv.store import open_store

url = f"file://{root}/store?capacity=1GiB"

def value_of(i):
    return bytes([i % 251]) * (value_bytes - 1) + bytes([i % 7])

def read(store, i):
    buf = bytearray(value_bytes)
    status = store.get_into([f"k{i:03d}"], [buf])[0]
    return status.value, bytes(buf) == value_of(i)

def describe():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "describe", "--store", url, "--json"],
        capture_output=True, text=True, check=False,
    )
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-2000:]

out = {}
store = open_store(url)
with capture_logs() as logs:
    out["put"] = [store.put([f"k{i:03d}"], [value_of(i)])[0].value for i in range(num_values)]
out["limited_logs"] = [
    {k: v for k, v in entry.items() if k in ("free_bytes", "capacity_bytes", "effective_capacity_bytes")}
    for entry in logs if entry["event"] == "store.file.space_limited"
]
out["newest_reads"] = [read(store, i) for i in range(num_values - 8, num_values)]
out["oldest_reads"] = [read(store, i)[0] for i in range(4)]
extra = store.stats().extra
out["effective_capacity_bytes"] = extra.get("effective_capacity_bytes")
try:  # what the workers' gauge store_effective_capacity_bytes sends
    from hybridkv.store.file import effective_capacity_of
except ImportError:
    out["gauge"] = None
else:
    out["gauge"] = effective_capacity_of(store)
out["cannot_write_after_fill"] = extra.get("cannot_write")
out["describe_after_fill"] = describe()

# Another writer takes what is free before the store re-reads the free space (never, on its own, from
# here): the next puts meet ENOSPC, evict and retry.
import hybridkv.store.file.usage as file_usage
file_usage.SPACE_REFRESH_S = float("inf")
filler = os.path.join(root, "filler")

def fill():
    with open(filler, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass

fill()
evicted_before = store.stats().extra["num_evicted_by_this_process"]
out["put_on_enospc"] = [
    store.put([f"k{i:03d}"], [value_of(i)])[0].value for i in range(num_values, num_values + 8)
]
out["reads_on_enospc"] = [read(store, i) for i in range(num_values, num_values + 8)]
out["evicted_on_enospc"] = store.stats().extra["num_evicted_by_this_process"] - evicted_before

# The other writer takes the whole file system, and the store holds nothing to evict: it cannot write.
store.remove_prefix("")
fill()
out["put_when_full"] = store.put(["full"], [value_of(0)])[0].value
out["cannot_write_when_full"] = store.stats().extra.get("cannot_write")
out["describe_when_full"] = describe()
os.unlink(filler)
out["put_after_free"] = store.put(["after"], [value_of(1)])[0].value
out["read_after_free"] = store.get_into(["after"], [bytearray(value_bytes)])[0].value
out["describe_after_free"] = describe()
store.close()
print(json.dumps(out))
"""


def test_a_full_file_system_below_capacity_evicts_keeps_saving_and_describe_tells(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    result = run_on_private_tmpfs(
        _CHILD,
        [str(root), str(_TMPFS_BYTES), str(_VALUE_BYTES), str(_NUM_VALUES)],
        mount_at=root,
        tmpfs_bytes=_TMPFS_BYTES,
        timeout=300,
    )

    assert result["put"] == ["ok"] * _NUM_VALUES, "a put failed after the file system filled"
    assert result["newest_reads"] == [["ok", True]] * 8, "the newest entries do not read back exact"
    assert result["oldest_reads"] == ["not_found"] * 4, "the oldest entries were not evicted"
    effective = result["effective_capacity_bytes"]
    assert _TMPFS_BYTES * 0.8 <= effective <= _TMPFS_BYTES, effective
    assert result["gauge"] == effective
    [logged] = result["limited_logs"]  # once per episode
    assert logged["capacity_bytes"] == 1 << 30
    assert logged["effective_capacity_bytes"] <= _TMPFS_BYTES
    assert 0 <= logged["free_bytes"] <= _TMPFS_BYTES
    assert result["cannot_write_after_fill"] is False
    assert result["describe_after_fill"][0] == 0, result["describe_after_fill"][1]

    assert result["put_on_enospc"] == ["ok"] * 8, "puts that met ENOSPC did not evict and retry"
    assert result["reads_on_enospc"] == [["ok", True]] * 8
    assert result["evicted_on_enospc"] > 0

    assert result["put_when_full"] == "no_space"
    assert result["cannot_write_when_full"] is True
    code, text = result["describe_when_full"]
    assert code == 1, text
    assert "cannot write" in text, text

    assert result["put_after_free"] == "ok"
    assert result["read_after_free"] == "ok"
    assert result["describe_after_free"][0] == 0, result["describe_after_free"][1]


def test_the_effective_capacity_gauge_is_a_file_store_s_own(tmp_path: Path) -> None:
    """A file store on a file system with room for its capacity reports that capacity; other kinds none."""
    from hybridkv.store import open_store
    from hybridkv.store.file import effective_capacity_of

    with open_store(f"file://{tmp_path}/store?capacity=1MiB") as store:
        assert store.put(["k"], [b"x" * 1024])[0].value == "ok"
        assert effective_capacity_of(store) == 1 << 20
        assert store.stats().extra["effective_capacity_bytes"] == 1 << 20
        assert store.stats().extra["cannot_write"] is False
    with open_store("memory://gauge?capacity=1MiB") as store:
        assert effective_capacity_of(store) is None
