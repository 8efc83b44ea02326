"""The file store on a file system that fills up, then turns read-only: real tmpfs, real ENOSPC / EROFS.

A child process gets a private mount namespace (``unshare --mount``) with a 1 MiB tmpfs, opens a file store whose
capacity is far above that (so the file system, not the store's eviction, runs out), and writes 2.5 MiB of
values one call at a time; then the tmpfs is remounted read-only and it writes and reads again. What must hold:
a full disk evicts the oldest values to make room (every put answers ``OK``, never an exception; issue 37 --
tests/store/test_full_disk.py has the rest of it), nothing is half-visible (every key that reads ``OK`` reads
back byte-exact, every other key is ``NOT_FOUND``, a reopened store lists exactly the keys that read), and a
read-only file system refuses writes with a status while every stored value still reads back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = r"""
import json, os, subprocess, sys, time
root = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], check=True)
from hybridkv.store import Status, open_store
from hybridkv.store.base import find_layer
from hybridkv.store.file import FileBackend

url = f"file://{root}/store?capacity=64MiB"
values = {f"k{i:02d}": bytes([i]) * 65536 for i in range(40)}
store = open_store(url)
put = {}
for key, value in values.items():
    put[key] = store.put([key], [value])[0].value
    # LRU goes by mtime, which the kernel stamps from a coarse clock (one tick: up to 10 ms): two puts in one
    # tick tie, and either may go first. Puts a tick apart make "the newest values are kept" exact.
    time.sleep(0.025)
# The last puts woke the background top-up; the reads below touch each value they find (a use, for LRU), so a
# top-up still running would rightly evict an older value that is not read yet before a newer one just read.
assert find_layer(store, FileBackend).layout.evictor.wait_idle(60), "the background top-up did not finish"

def read(s, key):
    buf = bytearray(len(values[key]))
    status = s.get_into([key], [buf])[0]
    return status.value, bytes(buf) == values[key]

reads = {key: read(store, key) for key in values}
store.close()
reopened = open_store(url)
listed = sorted(reopened.iter_keys(""))
reopened.close()
subprocess.run(["mount", "-o", "remount,ro", root], check=True)
out = {"put": put, "reads": reads, "listed": listed}
try:
    readonly = open_store(url)
except Exception as error:  # what an engine start would report
    out["ro_open_error"] = f"{type(error).__name__}: {error}"
else:
    out["ro_put"] = readonly.put(["late"], [b"x" * 4096])[0].value
    out["ro_reads"] = {key: read(readonly, key) for key, status in put.items() if status == "ok"}
    readonly.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("mount") is None, reason="needs unshare")
def test_a_full_then_read_only_file_system_answers_statuses_and_keeps_what_it_stored(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    proc = subprocess.run(
        ["unshare", "--mount", "--", sys.executable, "-c", _CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    put, reads = result["put"], result["reads"]
    assert set(put.values()) == {"ok"}, f"a full file system below the capacity refused puts: {put}"
    stored = sorted(key for key, read in reads.items() if read[0] == "ok")
    evicted = sorted(key for key, read in reads.items() if read[0] != "ok")
    assert stored and evicted, f"the 1 MiB file system never filled up or kept nothing: {reads}"
    for key in stored:
        assert reads[key] == ["ok", True], f"{key} reads back {reads[key]}"
    for key in evicted:
        assert reads[key][0] == "not_found", f"{key} evicted but half-visible: {reads[key]}"
    assert stored == sorted(put)[-len(stored) :], f"not the newest values were kept: {stored}"
    assert result["listed"] == stored, "a reopened store lists other keys than those stored"
    if "ro_open_error" in result:  # refused at open: a clear store error naming the folder
        assert result["ro_open_error"].startswith("StoreError"), result["ro_open_error"]
        assert str(root) in result["ro_open_error"], result["ro_open_error"]
    else:
        assert result["ro_put"] != "ok", "a write on a read-only file system answered ok"
        assert result["ro_reads"] == reads
