"""Chaos inside transfers: the writer, the master or a storage node killed or frozen while a multi-megabyte
batch is in flight. Whatever the moment, every key reads back either its exact bytes or ``NOT_FOUND`` --
never a half-visible entry, never ``OK`` with other bytes -- and the store comes back.

File store: writer children (``python -m support.chaos write``) put batches of multi-MiB scatter-gather
values, derived from their keys, into a ``file://`` directory on tmpfs, and each round kills one
(``SIGKILL``) at a moment of its own (``FILE_ROUNDS``): inside the payload's ``pwritev`` (a 48 MiB copy,
killed once its first bytes are in the temp file and its last are not), right before or right after the
``link(2)`` that publishes a frame (``strace`` holds that syscall, not the code), at a seeded moment, and
after a ``SIGSTOP`` that froze it mid-put while readers checked and this process raced it to the same keys.
Where each fault found the put is read back from what the writer left (``_where_the_put_was``). After each
kill: every key reads back bit-exact or ``NOT_FOUND`` (``support.chaos.read_outcomes``); the usage estimate
is off by at most one batch and the next eviction pass sets it exactly; leftover temp files survive passes
while fresh (a live writer's look the same) and the first pass after ``STALE_TMP_S`` removes them. At the
end a new process opens the directory and finds only complete entries.

Mooncake: a real ``mooncake_master`` and storage node (in the suite's private network namespace); a pure
client (an engine's) has a 64 MiB batch ``get_into`` and a 64 MiB batch ``put`` in flight when the master,
then the node, is frozen and then killed (``_fault_mid_batch``): the calls return within their deadline
with per-key statuses, every call abandoned at the deadline hands back its handle, nothing writes the
destinations once the handles are done, and after SIGCONT, a restart or the node's expiry a fresh client
reads every key exact or ``NOT_FOUND``.

The long form: ``HYBRIDKV_CHAOS_ROUNDS=N`` runs N file-store rounds (default: one of each kind) and
``HYBRIDKV_CHAOS_SEED`` draws other moments; with ``-s`` each test prints where its faults landed and what
the reads found.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.base import collect_late_calls
from hybridkv.store.file import FileBackend
from hybridkv.store.file import policy as file_policy
from hybridkv.store.file.layout import FileLayout
from hybridkv.store.frame import FIXED_HEADER_SIZE, check_frame, default_checksum, header_size, key_digest
from hybridkv.store.framed import FramedStore
from hybridkv.store.mooncake_node import DEFAULT_LEASE_TTL, READY_PREFIX, node_command
from hybridkv_dev.devkit.delay_proxy import read_child_line
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.chaos import chaos_key, first_mismatch, read_outcomes, size_of, value_parts, verify_keys
from support.hosts import DIE_WITH_PARENT
from support.mooncake import RPC_TIMEOUT_MS, SuiteMaster, assert_loopback_only_namespace, freeze_until_stopped
from support.paths import subprocess_env

#: The long form (module docstring) sets these: more file-store rounds, other seeds.
SEED = int(os.environ.get("HYBRIDKV_CHAOS_SEED", "20261202"))
NUM_FILE_ROUNDS = int(os.environ.get("HYBRIDKV_CHAOS_ROUNDS", "0"))  # 0: one round of each kind
#: Payload sizes the writer cycles through (not page multiples: frames end mid-page, like real ones).
FILE_SIZES = (4 << 20) + 17, (12 << 20) - 100
FILE_BATCH = 2
FILE_CAPACITY = 128 << 20
#: The payload the "kill inside pwritev" rounds put: one write of this size lasts tens of milliseconds.
BIG_SIZE = (48 << 20) + 3
#: A link(2) held this long by strace keeps the writer at the moment before or after publishing while the
#: test checks readers and kills it there.
LINK_DELAY_S = 0.6
#: How long to wait for a child to get somewhere: far beyond what it needs on an idle box.
CHILD_WAIT_S = 60.0
#: The outcomes of ``support.chaos.read_outcomes`` a read may have after a fault (the others are wrong).
GOOD_OUTCOMES = frozenset({"exact", "not_found"})


@pytest.fixture
def store_directory(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on tmpfs (``/dev/shm``) when there is one, else under ``tmp_path``."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path / "store"
        return
    directory = Path(tempfile.mkdtemp(prefix="hybridkv-chaos-", dir="/dev/shm"))
    try:
        yield directory / "store"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class WriterChild:
    """One ``python -m support.chaos write`` child (under ``tracer`` when given) and its progress file."""

    process: subprocess.Popen[bytes]
    progress: Path
    log: Path
    sizes: tuple[int, ...]
    batch: int
    #: The writer's own pid, from its ready line: under a tracer, ``process`` is the tracer.
    pid: int = 0

    @classmethod
    def start(
        cls,
        url: str,
        prefix: str,
        progress: Path,
        *,
        sizes: tuple[int, ...] = FILE_SIZES,
        batch: int = FILE_BATCH,
        tracer: Sequence[str] = (),
    ) -> WriterChild:
        """Start the writer and wait for its ready line (its store is open, its values ready)."""
        argv = [*DIE_WITH_PARENT, *tracer, sys.executable, "-m", "support.chaos", "write", url, prefix]
        argv += [str(progress), "--sizes", ",".join(str(size) for size in sizes), "--batch", str(batch)]
        log = progress.with_suffix(".log")
        with log.open("ab") as log_file:  # the writer's tracebacks, and the tracer's own messages
            process = subprocess.Popen(argv, env=subprocess_env(), stdout=log_file, stderr=subprocess.STDOUT)
        child = cls(process, progress, log, sizes, batch)
        try:
            child.wait_until("ready line", lambda: child.ready_pid() is not None)
        except BaseException:
            child.kill()
            raise
        child.pid = child.ready_pid() or 0
        return child

    @property
    def max_batch_bytes(self) -> int:
        """The most bytes one of its puts adds (frames: a payload plus a header of under 4 KiB)."""
        return self.batch * (max(self.sizes) + 4096)

    def lines(self) -> list[str]:
        try:
            return self.progress.read_text().splitlines()
        except FileNotFoundError:
            return []

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def ready_pid(self) -> int | None:
        lines = self.lines()
        return int(lines[0].split()[1]) if lines and lines[0].startswith("ready ") else None

    def begun_keys(self) -> list[str]:
        """Every key the child started to put."""
        return [key for line in self.lines() if line.startswith("begin ") for key in line.split()[1:]]

    def in_flight(self) -> list[str]:
        """The keys of the put the child is in (begun, not done), or ``[]`` between puts."""
        lines = self.lines()
        last = lines[-1] if lines else ""
        return last.split()[1:] if last.startswith("begin ") else []

    def num_done(self) -> int:
        return sum(line.startswith("done ") for line in self.lines())

    def done_statuses(self) -> dict[str, str]:
        """Each finished key's status as the child's put answered it."""
        statuses: dict[str, str] = {}
        for line in self.lines():
            if line.startswith("done "):
                for item in line.split()[1:]:
                    key, status = item.split("=", 1)
                    statuses[key] = status
        return statuses

    def wait_until(self, condition: str, check: Callable[[], bool], *, sleep_s: float = 0.005) -> None:
        """Poll ``check`` until true (``sleep_s=0``: busy, for moments that last milliseconds); fails
        naming ``condition`` if the child exits or takes longer than ``CHILD_WAIT_S``."""
        deadline = time.monotonic() + CHILD_WAIT_S
        while not check():
            assert self.process.poll() is None, (
                f"writer child exited ({self.process.returncode}) before {condition}: {self.log_tail()}"
            )
            assert time.monotonic() < deadline, f"writer child: no {condition} within {CHILD_WAIT_S} s"
            if sleep_s:
                time.sleep(sleep_s)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the child has stopped (see ``support.mooncake``)."""
        assert self.pid == self.process.pid, "only an untraced writer is frozen (its tracer would wait)"
        os.kill(self.pid, signal.SIGSTOP)
        _pid, status = os.waitpid(self.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"writer child did not stop (wait status {status:#x})"

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the writer (a tracer exits with it; a writer not yet ready dies with its tracer) and
        reap the child."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid or self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout=CHILD_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=CHILD_WAIT_S)


def _strace_link_delay(moment: str) -> list[str]:
    """A tracer that holds each ``link(2)`` of the writer ``LINK_DELAY_S`` before it runs (``moment="enter"``:
    the frame is written, not yet published) or after (``"exit"``: published, its temp name not yet
    unlinked). The syscalls are the real ones; only the writer's scheduling changes."""
    delay_us = int(LINK_DELAY_S * 1e6)
    return ["strace", "-f", "-qq", "--seccomp-bpf", "-o", "/dev/null", "-e", "trace=link,linkat",
            "-e", f"inject=link,linkat:delay_{moment}={delay_us}"]  # fmt: skip


def _temp_files(directory: Path) -> list[Path]:
    return sorted((directory / "tmp").iterdir())


def _has_temp_file(directory: Path) -> bool:
    return bool(os.listdir(directory / "tmp"))


def _read_at(path: Path, size: int, offset: int) -> bytes:
    """``size`` bytes of ``path`` at ``offset``; ``b""`` if the file is gone (a temp file unlinked)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _payload_partly_written(child: WriterChild, directory: Path) -> bool:
    """Whether a temp file holds the first bytes of an in-flight key's payload but not yet its last ones:
    the put is inside the payload's ``pwritev`` (which fills the file front to back)."""
    for key in child.in_flight():
        parts = value_parts(key)
        head, tail = parts[0][:16].tobytes(), parts[-1][-16:].tobytes()
        start = header_size(key)
        for temp in _temp_files(directory):
            if _read_at(temp, 16, start) == head and _read_at(temp, 16, start + size_of(key) - 16) != tail:
                return True
    return False


def _frame_sealed(child: WriterChild, directory: Path) -> bool:
    """Whether a temp file holds the header of an in-flight key (written last: the frame is whole). A
    claimed spare still holds its previous key's header until then."""
    digests = {key_digest(key) for key in child.in_flight()}
    return any(_read_at(temp, FIXED_HEADER_SIZE, 0)[28:44] in digests for temp in _temp_files(directory))


def _published(child: WriterChild, layout: FileLayout) -> bool:
    """Whether a key of the put in flight is published (linked) already."""
    return any(os.path.exists(layout.path_of(key)) for key in child.in_flight())


INSIDE_PWRITEV = "inside the payload's pwritev"
BEFORE_LINK = "frame written, not yet linked"
AFTER_LINK = "linked, temp name not yet unlinked"


def _where_the_put_was(directory: Path, layout: FileLayout, in_flight: list[str]) -> str:
    """Where a stopped or killed writer's put was, read from the files it left (see ``FrameWriter._publish``:
    a temp file, new at its final size or a claimed spare; the payload written front to back; the header
    sealed and written; linked; the temp name unlinked)."""
    if not in_flight:
        return "between puts"
    published = {}
    for key in in_flight:
        with contextlib.suppress(FileNotFoundError):
            published[key] = os.stat(layout.path_of(key)).st_ino
    for temp in _temp_files(directory):
        info = temp.stat()
        if info.st_ino in published.values():
            return AFTER_LINK
        for key in in_flight:
            header_bytes = header_size(key)
            if key in published or info.st_size != header_bytes + size_of(key):
                continue
            data = np.fromfile(temp, dtype=np.uint8)
            header, payload = memoryview(data[:header_bytes]), data[header_bytes:]
            if check_frame(key, header, [memoryview(payload)], required=default_checksum()) is None:
                return BEFORE_LINK
            written = first_mismatch(key, payload) // 4096 * 4096
            if written == 0:
                return (
                    "new temp file, nothing written" if not payload.any() else "spare claimed, not rewritten"
                )
            if written < payload.size // 4096 * 4096:
                return INSIDE_PWRITEV
            return "payload written, header not yet"
        return "spare claimed, not yet resized"
    return "in the put, no temp file"


def _file_backend(store: FramedStore) -> FileBackend:
    backend = store.backend
    assert isinstance(backend, FileBackend), f"not a file store: {backend!r}"
    return backend


def _real_bytes(store: FramedStore) -> tuple[int, int, int]:
    """The bytes really under objects/ and spare/, the usage estimate, and how far the spare estimate is
    off the bytes really under spare/."""
    stats = store.stats()
    assert stats.num_bytes is not None, "file store stats without num_bytes"
    spare = int(stats.extra["spare_bytes"])  # type: ignore[call-overload]
    estimate = int(stats.extra["usage_estimate_bytes"])  # type: ignore[call-overload]
    spare_drift = int(stats.extra["spare_estimate_bytes"]) - spare  # type: ignore[call-overload]
    return stats.num_bytes + spare, estimate, spare_drift


def _check_usage_and_sweep(store: FramedStore, directory: Path, max_batch_bytes: int, when: str) -> int:
    """The usage estimate after a fault is off by a bounded amount; an eviction pass sets it exactly and
    leaves fresh temp files alone; once they are older than ``STALE_TMP_S`` a pass removes them. Returns
    the number of leftover temp files.

    The bounds: high, because a killed put counted its batch before publishing it, and a writer killed
    inside an eviction pass leaves the estimate it had before the pass -- but any put that takes the
    estimate past capacity runs a pass, so it never exceeds capacity by more than one batch. Low, by the
    batch in flight when another process's pass rewrote the estimate (the racing round: the pass does not
    see the frozen put's bytes, which that put then gives back when its link finds the name taken)."""
    layout = _file_backend(store).layout
    real, estimate, _spare_drift = _real_bytes(store)
    assert real - max_batch_bytes <= estimate <= FILE_CAPACITY + max_batch_bytes, (
        f"{when}: usage estimate {estimate} vs {real} bytes stored, capacity {FILE_CAPACITY}"
    )
    leftovers = _temp_files(directory)
    assert layout.make_room(0), f"{when}: the eviction pass did not run (evict.lock held by a dead writer?)"
    assert _temp_files(directory) == leftovers, f"{when}: a pass removed a fresh temp file (a live put's?)"
    long_ago = time.time() - 2 * file_policy.STALE_TMP_S
    for temp in leftovers:
        os.utime(temp, (long_ago, long_ago))
    assert layout.make_room(0), f"{when}: the second eviction pass did not run"
    assert _temp_files(directory) == [], f"{when}: stale temp files survived a pass"
    real, estimate, spare_drift = _real_bytes(store)
    assert (estimate, spare_drift) == (real, 0), f"{when}: after a pass usage {estimate} != {real} stored"
    assert real <= FILE_CAPACITY, f"{when}: {real} bytes stored, capacity {FILE_CAPACITY}"
    return len(leftovers)


@dataclass
class FileChaos:
    """What the file-store rounds share: the store, its directory, and the tallies the test reports."""

    url: str
    directory: Path
    store: FramedStore
    tmp_path: Path
    rng: random.Random
    #: Where each fault found the writer's put, per round kind.
    landed: Counter[str] = field(default_factory=Counter)
    #: What every key read after each fault (``support.chaos.read_outcomes``'s outcomes).
    outcomes: Counter[str] = field(default_factory=Counter)
    #: Every key a writer began to put, in all rounds so far.
    attempted: list[str] = field(default_factory=list)
    num_leftovers: int = 0
    num_writers: int = 0

    @property
    def layout(self) -> FileLayout:
        return _file_backend(self.store).layout

    def start_writer(self, **options: object) -> WriterChild:
        """A new writer child (``WriterChild.start``'s options) putting keys under a prefix of its own."""
        prefix = f"w{self.num_writers}"
        self.num_writers += 1
        return WriterChild.start(self.url, prefix, self.tmp_path / f"progress-{prefix}", **options)  # type: ignore[arg-type]

    def check_reads(self, keys: list[str], when: str) -> None:
        """A fresh store's view of every key (see ``verify_keys``); fails on any wrong outcome."""
        with open_store(self.url) as fresh:
            counts = verify_keys(fresh, keys)
        wrong = {outcome: count for outcome, count in counts.items() if outcome not in GOOD_OUTCOMES}
        assert not wrong, f"{when}: wrong reads {wrong} (all: {dict(counts)})"
        self.outcomes.update(counts)

    def in_flight_reads(self, child: WriterChild) -> Counter[str]:
        """How a fresh store reads the keys of the child's put in flight."""
        with open_store(self.url) as fresh:
            return verify_keys(fresh, child.in_flight())

    def record(self, kind: str, child: WriterChild) -> str:
        where = _where_the_put_was(self.directory, self.layout, child.in_flight())
        self.landed[f"{kind}: {where}"] += 1
        return where

    def after_kill(self, kind: str, child: WriterChild, when: str) -> str:
        """Record where the kill landed, check every key put so far and the accounting, sweep leftovers."""
        where = self.record(kind, child)
        self.attempted += child.begun_keys()
        self.check_reads(self.attempted, f"{when}, writer killed ({where})")
        self.num_leftovers += _check_usage_and_sweep(self.store, self.directory, child.max_batch_bytes, when)
        return where


def _kill_inside_pwritev(chaos: FileChaos, when: str) -> None:
    """SIGKILL while the put's ``pwritev`` copies a 48 MiB payload: once its first bytes are in the temp file
    and its last are not. Up to three writers, until one dies inside the call (what it left says; a loaded
    box can let the copy finish between the check and the kill)."""
    wheres = []
    for _attempt in range(3):
        child = chaos.start_writer(sizes=(BIG_SIZE,), batch=1)
        try:
            child.wait_until(
                "a payload half written",
                lambda c=child: _payload_partly_written(c, chaos.directory),
                sleep_s=0,
            )
        finally:
            child.kill()
        wheres.append(chaos.after_kill("kill inside pwritev", child, when))
        if wheres[-1] == INSIDE_PWRITEV:
            return
    raise AssertionError(f"{when}: no kill landed inside the payload's pwritev: {wheres}")


def _stop_at_temp_race_then_kill(chaos: FileChaos, when: str) -> None:
    """SIGSTOP as soon as the put's temp file appears (the stop lands between syscalls: before or after
    the payload's write); readers check; this process puts the same keys (first writer wins); SIGCONT: the
    frozen put answers OK and the bytes are exact; then SIGKILL at a seeded moment."""
    child = chaos.start_writer()
    try:
        num_batches = chaos.rng.randrange(0, 3)  # whole batches first: faults also land in passes, spares
        child.wait_until(f"{num_batches} batches", lambda: child.num_done() >= num_batches)
        child.wait_until("a temp file", lambda: _has_temp_file(chaos.directory), sleep_s=0)
        child.freeze()
        in_flight = child.in_flight()
        assert in_flight, f"{when}: a temp file but no put in flight"
        chaos.record("stop at temp (frozen)", child)
        chaos.check_reads(child.begun_keys(), f"{when}, writer frozen")
        # Another writer puts the keys in flight (the same bytes: values derive from keys).
        statuses = chaos.store.put(in_flight, [value_parts(key) for key in in_flight])
        assert statuses == [Status.OK] * len(in_flight), f"{when}: the racing put answered {statuses}"
        child.thaw()
        child.wait_until("the frozen put's done line", lambda: set(in_flight) <= child.done_statuses().keys())
        answered = {key: child.done_statuses()[key] for key in in_flight}
        assert set(answered.values()) == {"ok"}, f"{when}: the frozen put answered {answered}"
        time.sleep(chaos.rng.uniform(0.0, 0.3))
    finally:
        child.kill()
    chaos.after_kill("stop at temp, race, kill at random", child, when)


def _kill_at_random(chaos: FileChaos, when: str) -> None:
    """SIGKILL at a seeded moment: in a put, an eviction pass, a spare claim, between puts..."""
    child = chaos.start_writer()
    try:
        time.sleep(chaos.rng.uniform(0.0, 0.4))
    finally:
        child.kill()
    chaos.after_kill("kill at random", child, when)


def _kill_at_link(chaos: FileChaos, when: str, moment: str) -> None:
    """SIGKILL while ``link(2)`` publishing the first put's frame is held (``_strace_link_delay``): before
    it (``enter``: the key must read NOT_FOUND meanwhile) or after it (``exit``: the key reads exact though
    the temp name is still there). What the writer left must say so. Without ``strace`` the round is not
    run (a warning says so; the other rounds still are)."""
    if shutil.which("strace") is None:
        warnings.warn(
            f"{when}: not run: strace is not installed (it holds the writer at its link(2))", stacklevel=2
        )
        chaos.landed[f"kill at link {moment}: not run, no strace"] += 1
        return
    child = chaos.start_writer(batch=1, tracer=_strace_link_delay(moment))
    try:
        if moment == "enter":
            child.wait_until("a sealed frame", lambda: _frame_sealed(child, chaos.directory), sleep_s=0.001)
        else:
            child.wait_until("a published key", lambda: _published(child, chaos.layout), sleep_s=0.001)
        reads = chaos.in_flight_reads(child)
        expected = {"not_found": 1} if moment == "enter" else {"exact": 1}
        assert reads == expected, (
            f"{when}: the key being linked read {dict(reads)} while held at link {moment}"
        )
    finally:
        child.kill()
    where = chaos.after_kill(f"kill at link {moment}", child, when)
    assert where == (BEFORE_LINK if moment == "enter" else AFTER_LINK), f"{when}: the kill landed {where!r}"


FILE_ROUNDS: dict[str, Callable[[FileChaos, str], None]] = {
    "kill inside pwritev": _kill_inside_pwritev,
    "stop at temp, race, kill": _stop_at_temp_race_then_kill,
    "kill at random": _kill_at_random,
    "kill before link": lambda chaos, when: _kill_at_link(chaos, when, "enter"),
    "kill after link": lambda chaos, when: _kill_at_link(chaos, when, "exit"),
}


def test_file_store_writer_killed_and_frozen_mid_transfer(store_directory: Path, tmp_path: Path) -> None:
    """Seeded rounds cycling through ``FILE_ROUNDS`` (see each one's docstring), each on a new writer child
    killed at the end; after each kill every key reads exact or NOT_FOUND and the accounting is checked
    (``FileChaos.after_kill``). Finally a new process finds only complete entries."""
    url = f"file://{store_directory}?capacity={FILE_CAPACITY}"
    chaos = FileChaos(url, store_directory, open_store(url), tmp_path, random.Random(SEED))
    kinds = list(FILE_ROUNDS)
    try:
        for round_index in range(max(NUM_FILE_ROUNDS, len(kinds))):
            kind = kinds[round_index % len(kinds)]
            FILE_ROUNDS[kind](chaos, f"round {round_index} ({kind})")
        keys_file = tmp_path / "attempted.json"
        keys_file.write_text(json.dumps(chaos.attempted))
        verify = subprocess.run(
            [sys.executable, "-m", "support.chaos", "verify", url, str(keys_file)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=CHILD_WAIT_S,
            check=False,
        )
    finally:
        chaos.store.close()
    assert verify.returncode == 0, f"fresh-process verify failed: {verify.stderr[-3000:]}"
    report = json.loads(verify.stdout.splitlines()[-1])
    assert set(report["keys"]) <= GOOD_OUTCOMES, f"a fresh process read wrong outcomes: {report}"
    assert set(report["listed"]) <= {"exact"}, f"a fresh process lists an incomplete entry: {report}"
    assert report["listed_unknown"] == [], f"entries nobody put: {report['listed_unknown']}"
    assert report["keys"].get("exact", 0) == sum(report["listed"].values()), report
    print(
        f"\nfile store chaos: {max(NUM_FILE_ROUNDS, len(kinds))} rounds; faults landed "
        f"{dict(sorted(chaos.landed.items()))}; reads after faults {dict(chaos.outcomes)}; "
        f"leftover temp files swept {chaos.num_leftovers}; fresh process {report['keys']}"
    )


# -- Mooncake: the master and a storage node killed or frozen mid-batch ----------------------------------

#: The batch in flight: 32 values of 2 MiB (two 1 MiB parts each: header + 2 slices per key over TCP).
MOONCAKE_BATCH = 32
MOONCAKE_VALUE_BYTES = 2 << 20
#: The engine-like client's deadline: the suite's Mooncake RPC timeout (``support.mooncake``), so that a
#: frozen master's calls end inside Mooncake at about the same moment.
VICTIM_TIMEOUT_MS = RPC_TIMEOUT_MS
#: Every client's breaker retries after this (the URL default, 5 s, would only make the test wait).
BREAKER_RESET_S = 0.5
#: Clients that only set up and check (not under test): a deadline no loaded box reaches.
CHECKER_TIMEOUT_MS = 10_000
#: A faulted call must have returned this long after its deadline (a hang would be 30-60 s: Mooncake's own
#: RPC and TCP timeouts), and its late handle must be done this long after the fault is undone.
CALL_BOUND_S = VICTIM_TIMEOUT_MS / 1000 + 10.0
LATE_BOUND_S = 60.0
#: Rounds whose calls both returned before the fault are run again, sooner; at most this many in all.
MAX_FAULT_ATTEMPTS = 5
#: How long a destination is watched after its call's handle is done, for writes that should not come.
WATCH_S = 0.3
SENTINEL = 0xA5
#: Outcomes of a fresh client's read that are no answer yet, retried for ``RETRY_S``: a transfer from a node
#: just thawed or not yet expired, a lease that ran out under load, a deadline. Wrong bytes and ``CORRUPT``
#: are answers: never retried.
TRANSIENT_OUTCOMES = frozenset({"get_transfer_failed", "get_timeout", "exists_disagrees"})
RETRY_S = 30.0
#: What this process allocates while abandoned calls wait (an engine goes on working): small objects of every
#: size a frame header has, so that a call reading a buffer its caller's store let go of picks up this byte.
CHURN_BYTE = 0x5A
NODE_SEGMENT_BYTES = 512 << 20


@dataclass
class StorageNode:
    """A storage node child (``python -m hybridkv.store.mooncake_node``, as ``hybridkv mooncake node``
    starts it) on 127.0.0.1, mounting ``NODE_SEGMENT_BYTES`` into ``master``'s pool."""

    master: MooncakeMaster
    log_path: Path
    process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "storage node already running"
        argv = [
            *DIE_WITH_PARENT,
            *node_command(self.master.address, "127.0.0.1", segment_bytes=NODE_SEGMENT_BYTES),
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.process.stdout is not None
        line = read_child_line(self.process.stdout, CHILD_WAIT_S)
        assert line.startswith(READY_PREFIX + " "), f"storage node not ready ({line!r}); see {self.log_path}"

    def running(self) -> subprocess.Popen[str]:
        assert self.process is not None and self.process.poll() is None, "storage node not running"
        return self.process

    def kill(self) -> None:
        process = self.running()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=CHILD_WAIT_S)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread has stopped (``support.mooncake.freeze_until_stopped``)."""
        process = self.running()
        process.send_signal(signal.SIGSTOP)
        _pid, status = os.waitpid(process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"storage node did not stop (wait status {status:#x})"

    def thaw(self) -> None:
        self.running().send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL: a test node's entries need no goodbye (a graceful close takes a second)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=CHILD_WAIT_S)
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()


class ChaosMaster(SuiteMaster):
    """The suite's master, killed by the kernel when the test process dies (the test restarts it, so a test
    killed mid-round would otherwise leave the restarted one behind)."""

    def command(self) -> list[str]:
        return [*DIE_WITH_PARENT, *super().command()]


@pytest.fixture
def chaos_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of the test's own (``support.mooncake.new_master``'s) with the product's read lease
    (``DEFAULT_LEASE_TTL``, 2 s) instead of the suite's 200 ms: a reader drops a value whose lease expired
    before its transfer completed, and a 64 MiB batch takes longer than 200 ms on a loaded box."""
    assert_loopback_only_namespace()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    master = ChaosMaster(
        tmp_path / "master.log", lease_ttl=DEFAULT_LEASE_TTL, client_ttl_s=3, start_timeout_s=10.0
    )
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def storage_node(chaos_master: MooncakeMaster, tmp_path: Path) -> Iterator[StorageNode]:
    """A storage node on the test's own master (started; the test may kill, freeze and restart it)."""
    node = StorageNode(chaos_master, tmp_path / "storage-node.log")
    try:
        node.start()
        yield node
    finally:
        node.stop()


class InFlightCall:
    """One store call on a thread of its own, with the completion handles it hands back if it answers late."""

    def __init__(self, name: str, call: Callable[[], list[Status]]) -> None:
        """Start ``call`` now, on a daemon thread named after ``name``."""
        self.name = name
        self.statuses: list[Status] | None = None
        self.late: list[Future[object]] = []
        self.error: BaseException | None = None
        #: Whether the call was still running when the fault was injected (the signal sent).
        self.running_at_fault = False
        self.elapsed_s = 0.0
        self.thread = threading.Thread(target=self._run, args=(call,), name=f"chaos-{name}", daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], list[Status]]) -> None:
        started = time.monotonic()
        try:
            with collect_late_calls() as late:
                self.statuses = call()
            self.late = late
            self.elapsed_s = time.monotonic() - started
        except BaseException as error:  # noqa: BLE001 -- reported by ``returned``, which fails on it
            self.error = error

    def returned(self, num_keys: int, when: str) -> list[Status]:
        """Its statuses, once it has returned within ``CALL_BOUND_S``: one per key, no exception; a call
        that handed back a late handle answered ``TIMEOUT`` for every key."""
        self.thread.join(timeout=CALL_BOUND_S)
        assert not self.thread.is_alive(), (
            f"{when}: {self.name} still running {CALL_BOUND_S} s after the fault"
        )
        assert self.error is None, f"{when}: {self.name} raised {self.error!r}"
        assert self.statuses is not None and len(self.statuses) == num_keys, (
            f"{when}: {self.name} {self.statuses}"
        )
        if self.late:
            assert set(self.statuses) == {Status.TIMEOUT}, (
                f"{when}: {self.name} late but answered {self.statuses}"
            )
        return self.statuses


def _mooncake_keys(prefix: str) -> list[str]:
    return [chaos_key(prefix, index, MOONCAKE_VALUE_BYTES) for index in range(MOONCAKE_BATCH)]


def _values(keys: Sequence[str]) -> list[list[np.ndarray]]:
    return [value_parts(key) for key in keys]


def _num_abandoned(store: FramedStore) -> int:
    return int(store.stats().extra["num_abandoned_calls"])  # type: ignore[call-overload]


@dataclass
class MidBatchFault:
    """What one fault did to the victim client's get and put in flight (see ``_fault_mid_batch``)."""

    get: InFlightCall
    put: InFlightCall
    get_statuses: list[Status]
    put_statuses: list[Status]
    destinations: list[np.ndarray]
    #: The keys the put of every attempt offered (the last attempt's was in flight at the fault).
    put_keys: list[str]
    num_attempts: int

    @property
    def late(self) -> list[Future[object]]:
        return self.get.late + self.put.late

    def wait_until_done_then_watch(self, when: str) -> None:
        """Once every late handle is done (within ``LATE_BOUND_S``: call after the fault is undone), fill the
        destinations with a sentinel and check for ``WATCH_S`` that nothing writes them any more."""
        _done, pending = wait(self.late, timeout=LATE_BOUND_S)  # the abandoned calls' outcomes do not matter
        assert not pending, (
            f"{when}: {len(pending)} late calls still running {LATE_BOUND_S} s after the fault"
        )
        for destination in self.destinations:
            destination.fill(SENTINEL)
        time.sleep(WATCH_S)
        written = [
            index for index, destination in enumerate(self.destinations) if (destination != SENTINEL).any()
        ]
        assert not written, f"{when}: destinations {written} written after the get's handle was done"

    def summary(self) -> dict[str, object]:
        return {
            "get": dict(Counter(status.value for status in self.get_statuses)),
            "put": dict(Counter(status.value for status in self.put_statuses)),
            "late_handles": len(self.late),
            "attempts": self.num_attempts,
            "in_flight_at_fault": [call.name for call in (self.get, self.put) if call.running_at_fault],
        }


def _fault_mid_batch(
    victim: FramedStore, fault: Callable[[], None], *, get_keys: list[str], put_prefix: str, delay_s: float,
    when: str,
) -> MidBatchFault:  # fmt: skip
    """Start a batch ``get_into`` of ``get_keys`` and a batch ``put`` of new keys under ``put_prefix`` on
    ``victim`` (two threads), run ``fault`` after ``delay_s``, and check how both calls answered: within
    ``CALL_BOUND_S``, one status per key, no exception; every call the deadline abandoned handed back its
    handle; every ``OK`` read holds the exact bytes.

    The fault comes only while a call is in flight: if both have returned by then (the box ran them faster
    than the delay foresaw), the round starts again, new keys, half the delay -- ``MAX_FAULT_ATTEMPTS`` in
    all. ``MidBatchFault.put_keys`` are the keys of every attempt."""
    put_keys: list[str] = []
    for attempt in range(MAX_FAULT_ATTEMPTS):
        attempt_keys = _mooncake_keys(f"{put_prefix}{attempt}")
        put_keys += attempt_keys
        destinations = [np.zeros(MOONCAKE_VALUE_BYTES, dtype=np.uint8) for _ in get_keys]
        abandoned_before = _num_abandoned(victim)
        get = InFlightCall("get_into", lambda d=destinations: victim.get_into(get_keys, d))
        put = InFlightCall("put", lambda k=attempt_keys: victim.put(k, _values(k)))
        time.sleep(delay_s * 0.5**attempt)
        get.running_at_fault, put.running_at_fault = get.thread.is_alive(), put.thread.is_alive()
        if get.running_at_fault or put.running_at_fault:
            fault()
            break
        get.returned(len(get_keys), when)
        put.returned(len(attempt_keys), when)
    else:
        raise AssertionError(
            f"{when}: the calls returned before the fault in all {MAX_FAULT_ATTEMPTS} attempts"
        )
    get_statuses = get.returned(len(get_keys), when)
    put_statuses = put.returned(len(attempt_keys), when)
    # This process goes on allocating while the abandoned calls wait, as an engine does: a call still
    # reading a buffer its store let go of would store these bytes.
    churn = [bytes([CHURN_BYTE]) * size for size in range(16, 160) for _ in range(1000)]
    abandoned = _num_abandoned(victim) - abandoned_before
    assert len(get.late) + len(put.late) == abandoned, (
        f"{when}: {abandoned} calls abandoned at the deadline, {len(get.late) + len(put.late)} handles handed back"
    )
    for key, status, destination in zip(get_keys, get_statuses, destinations, strict=True):
        if status is Status.OK:
            assert first_mismatch(key, destination) == MOONCAKE_VALUE_BYTES, (
                f"{when}: {key} OK with other bytes"
            )
    del churn  # freed, its bytes stay where a late call reading freed memory would find them
    return MidBatchFault(get, put, get_statuses, put_statuses, destinations, put_keys, attempt + 1)


def _fresh_reads(url: str, keys: list[str], clients: list[FramedStore], when: str) -> Counter[str]:
    """A new client's ``exists`` + ``get_into`` of every key (``read_outcomes``), transient outcomes retried
    for ``RETRY_S``; every key must end exact or NOT_FOUND. The client joins ``clients`` (closed at the end:
    a Mooncake close takes a second)."""
    fresh = open_store(url)
    clients.append(fresh)
    outcomes = dict(zip(keys, read_outcomes(fresh, keys), strict=True))
    deadline = time.monotonic() + RETRY_S
    while (retry := [key for key, outcome in outcomes.items() if outcome in TRANSIENT_OUTCOMES]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
        outcomes.update(zip(retry, read_outcomes(fresh, retry), strict=True))
    counts = Counter(outcomes.values())
    wrong = {key: outcome for key, outcome in outcomes.items() if outcome not in GOOD_OUTCOMES}
    assert not wrong, f"{when}: a fresh client read {dict(counts)}; e.g. {dict(list(wrong.items())[:4])}"
    return counts


def _wait_until_serves(store: FramedStore, keys: list[str], what: str) -> None:
    """Retry until a put of a new key answers OK and it and ``keys`` read back exact: the client serves again
    (a restarted master and the node re-mounted on it, a breaker's reset, transfer lanes to a thawed node
    re-established)."""
    deadline = time.monotonic() + RETRY_S
    while True:
        probe = chaos_key("probe", time.monotonic_ns(), 4096)
        outcomes: list[str] = []
        if store.put([probe], [value_parts(probe)]) == [Status.OK]:
            outcomes = read_outcomes(store, [probe, *keys])
            if set(outcomes) == {"exact"}:
                return
        assert time.monotonic() < deadline, f"{what}: not serving after {RETRY_S} s: {Counter(outcomes)}"
        time.sleep(0.1)


def _close_all(stores: Sequence[FramedStore]) -> None:
    """Close the clients at once (each Mooncake close takes about a second)."""
    threads = [threading.Thread(target=store.close, daemon=True) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=CALL_BOUND_S)


def _fault_delay(rng: random.Random, scale_s: float) -> float:
    """A seeded moment inside the victim's two calls: within the first half of one warm batch read (the two
    calls in flight at once take longer), and before half their deadline (on a loaded box the calls may
    reach it by themselves, and then the fault would find them done)."""
    return min(rng.uniform(0.0, 0.5) * scale_s, VICTIM_TIMEOUT_MS / 1000 / 2)


def _put_and_time_a_get(store: FramedStore, keys: list[str]) -> float:
    """Put ``keys`` (must work), read them back twice, and return how long the second read took (warm
    connections, fresh destinations: like the victim's reads): the scale of the fault delays."""
    assert store.put(keys, _values(keys)) == [Status.OK] * len(keys), "the setup put failed"
    elapsed_s = 0.0
    for _ in range(2):
        destinations = [np.zeros(MOONCAKE_VALUE_BYTES, dtype=np.uint8) for _ in keys]
        started = time.monotonic()
        assert store.get_into(keys, destinations) == [Status.OK] * len(keys), "the setup read failed"
        elapsed_s = time.monotonic() - started
    return elapsed_s


def _clients(master: MooncakeMaster) -> tuple[FramedStore, FramedStore, str]:
    """Pure clients (``segment=0``: their puts land on the storage node) of ``master``: a checker that sets
    up and waits (a deadline no loaded box reaches), the victim (an engine's: ``VICTIM_TIMEOUT_MS``), and
    the URL of the fresh clients that check; all with breakers that retry after ``BREAKER_RESET_S``."""
    checker_url = master.url(segment=0, timeout_ms=CHECKER_TIMEOUT_MS, breaker_reset_s=BREAKER_RESET_S)
    victim = open_store(master.url(segment=0, timeout_ms=VICTIM_TIMEOUT_MS, breaker_reset_s=BREAKER_RESET_S))
    return open_store(checker_url), victim, checker_url


@pytest.mark.mooncake
@pytest.mark.slow
def test_mooncake_master_frozen_then_killed_mid_batch(
    chaos_master: MooncakeMaster, storage_node: StorageNode
) -> None:
    """A pure client (an engine) has a 64 MiB ``get_into`` and a 64 MiB ``put`` in flight when the master
    is frozen (SIGSTOP), then -- second round -- killed (SIGKILL). Both calls return within their deadline
    with per-key statuses (``_fault_mid_batch``); after SIGCONT a fresh client reads every key exact or
    NOT_FOUND, the entries stored before the freeze exact; after a restart (which forgets every object:
    docs/failure-semantics.md) NOT_FOUND; the client serves again once its breaker lets it."""
    master = chaos_master
    rng = random.Random(SEED + 1)
    checker, victim, fresh_url = _clients(master)
    clients = [checker, victim]
    a = _mooncake_keys("m-a")
    try:
        scale_s = _put_and_time_a_get(checker, a)
        when = "master frozen mid-batch"
        frozen = _fault_mid_batch(
            victim,
            lambda: freeze_until_stopped(master),
            get_keys=a,
            put_prefix="m-b",
            delay_s=_fault_delay(rng, scale_s),
            when=when,
        )
        master.thaw()
        frozen.wait_until_done_then_watch(when)
        after_thaw = _fresh_reads(fresh_url, a + frozen.put_keys, clients, f"{when}, after SIGCONT")
        assert after_thaw["exact"] >= len(a), f"{when}: entries stored before the freeze lost: {after_thaw}"
        _wait_until_serves(victim, a, f"{when}: the victim after SIGCONT")

        when = "master killed mid-batch"
        killed = _fault_mid_batch(
            victim, master.kill, get_keys=a, put_prefix="m-c", delay_s=_fault_delay(rng, scale_s), when=when
        )
        killed.wait_until_done_then_watch(when)
        master.start()
        _wait_until_serves(checker, [], f"{when}: the node re-mounted on the restarted master")
        all_keys = a + frozen.put_keys + killed.put_keys
        after_restart = _fresh_reads(fresh_url, all_keys, clients, f"{when}, after the restart")
        _wait_until_serves(victim, [], f"{when}: the victim after the restart")
    finally:
        if master.process is not None and master.process.poll() is None:
            master.thaw()
        _close_all(clients)
    print(
        f"\nmooncake master chaos: frozen {frozen.summary()}, fresh reads after SIGCONT {dict(after_thaw)}; "
        f"killed {killed.summary()}, fresh reads after the restart {dict(after_restart)}"
    )


@pytest.mark.mooncake
@pytest.mark.slow
def test_mooncake_storage_node_frozen_then_killed_mid_batch(
    chaos_master: MooncakeMaster, storage_node: StorageNode
) -> None:
    """The same batches in flight when the storage node holding the data is frozen, then killed. Frozen:
    the transfers stall, the calls answer ``TIMEOUT`` at their deadline and hand back their handles, done
    soon after SIGCONT; nothing writes the destinations after that; every entry reads exact or NOT_FOUND
    -- the put abandoned mid-transfer included, although this process allocated meanwhile (a put whose
    header buffers were freed at its deadline stored those bytes as headers: ``CORRUPT``). Killed: the
    calls return with per-key failures; once the master has expired the dead node (``--client_ttl``) a
    fresh client reads NOT_FOUND, a new node takes puts, and the client serves again."""
    master = chaos_master
    rng = random.Random(SEED + 2)
    checker, victim, fresh_url = _clients(master)
    clients = [checker, victim]
    a = _mooncake_keys("n-a")
    try:
        scale_s = _put_and_time_a_get(checker, a)
        when = "node frozen mid-batch"
        frozen = _fault_mid_batch(
            victim,
            storage_node.freeze,
            get_keys=a,
            put_prefix="n-b",
            delay_s=_fault_delay(rng, scale_s),
            when=when,
        )
        storage_node.thaw()
        frozen.wait_until_done_then_watch(when)
        after_thaw = _fresh_reads(fresh_url, a + frozen.put_keys, clients, f"{when}, after SIGCONT")
        # Frozen for about the deadline, well within the master's client TTL: the node's entries stay.
        assert after_thaw["exact"] >= len(a), f"{when}: entries stored before the freeze lost: {after_thaw}"
        _wait_until_serves(victim, a, f"{when}: the victim after SIGCONT")

        when = "node killed mid-batch"
        killed = _fault_mid_batch(
            victim,
            storage_node.kill,
            get_keys=a,
            put_prefix="n-c",
            delay_s=_fault_delay(rng, scale_s),
            when=when,
        )
        killed.wait_until_done_then_watch(when)
        storage_node.start()
        deadline = time.monotonic() + RETRY_S
        while checker.exists(a[:1]) != [Status.NOT_FOUND]:  # until the master expires the dead node
            assert time.monotonic() < deadline, f"{when}: the dead node's keys still listed after {RETRY_S} s"
            time.sleep(0.2)
        _wait_until_serves(checker, [], f"{when}: puts onto the new node")
        all_keys = a + frozen.put_keys + killed.put_keys
        after_kill = _fresh_reads(fresh_url, all_keys, clients, f"{when}, after the node expired")
        assert set(after_kill) == {"not_found"}, f"{when}: the dead node's entries read {dict(after_kill)}"
        _wait_until_serves(victim, [], f"{when}: the victim after the node was replaced")
    finally:
        if storage_node.process is not None and storage_node.process.poll() is None:
            storage_node.thaw()
        _close_all(clients)
    print(
        f"\nmooncake node chaos: frozen {frozen.summary()}, fresh reads after SIGCONT {dict(after_thaw)}; "
        f"killed {killed.summary()}, fresh reads after expiry {dict(after_kill)}"
    )
