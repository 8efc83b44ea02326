"""A router's view of the shared tier, from a real subscriber on vLLM's ZMQ KV-event publisher.

Two real engines (in-process vLLM, CPU build, tiny Llama), each its own process (``kv_events_engine.py``),
churn one ``file://`` store far smaller than what they store, with prompts of their own. Each engine
publishes through vLLM's ``ZmqEventPublisher`` (``KVEventsConfig(publisher="zmq")``) to one SUB socket
this test binds on loopback (the publisher connects to a non-wildcard TCP address), topic = engine name;
the batches are decoded with msgspec as vLLM's ``KVEventBatch``.

1. Both engines churn at once, then engine a stores two prompts more (they fit); both flush (drain the
   store's eviction log, publish). Per engine, the view its ``STORAGE`` events imply (stored minus
   removed, in sequence order) equals the store's listing of the blocks that engine stored, and names no
   block the store does not hold.
2. Engine b alone churns again: its process evicts engine a's blocks while a puts nothing. After both
   flush, the same holds, and a's view shrank: a learnt of b's evictions from the shared eviction log.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from support.paths import subprocess_env, write_json_whole

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCRIPT = Path(__file__).with_name("kv_events_engine.py")
ENGINES = ("a", "b")
BLOCK = 128  # tokens per block of the tiny Llama here
PROMPT_BLOCKS = 4
NUM_PROMPTS = 8
#: About 24 of the tiny Llama's 64 KiB blocks; each churn stores 32 per engine.
CAPACITY = "1600KiB"
WAIT_S = 240.0


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(PROMPT_BLOCKS * BLOCK)] for _ in range(NUM_PROMPTS)]


def _listing(store_url: str) -> set[bytes]:
    """The block hashes of the store's block entries (a manifest is none), listed by a handle of its own."""
    from hybridkv.connector.identity import MANIFEST_NAME
    from hybridkv.store import open_store

    store = open_store(store_url)
    try:
        return {
            bytes.fromhex(key.rpartition("/")[2])
            for key in store.iter_keys("hkv1/")
            if not key.endswith(MANIFEST_NAME)
        }
    finally:
        store.close()


class _Subscriber:
    """One SUB socket bound on loopback that every engine's publisher connects to: the batches per topic,
    with their sequence numbers, decoded as vLLM's ``KVEventBatch``."""

    def __init__(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind("tcp://127.0.0.1:0")
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.batches: dict[str, list[tuple[int, Any]]] = {name: [] for name in ENGINES}

    def poll(self, timeout_ms: int) -> None:
        """Take whatever arrived, waiting at most ``timeout_ms`` for the first message."""
        while self._sock.poll(timeout_ms):
            topic, seq, payload = self._sock.recv_multipart()
            self.batches[topic.decode()].append((int.from_bytes(seq, "big"), self._decoder.decode(payload)))
            timeout_ms = 0

    def close(self) -> None:
        self._sock.close(linger=0)


class _Engines:
    """The engine processes and their command files (see ``kv_events_engine.py``)."""

    def __init__(self, tmp_path: Path, sub: _Subscriber, spec: dict[str, Any]) -> None:
        self.tmp_path = tmp_path
        self.sub = sub
        self.control = tmp_path / "control"
        self.control.mkdir()
        self.num_commands = 0
        self.results: dict[str, dict[str, Any]] = {}
        # The script imports support.
        env = subprocess_env(dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in ENGINES:
            spec_path = tmp_path / f"{name}.json"
            spec_path.write_text(json.dumps({**spec, "name": name, "control": str(self.control)}))
            with (tmp_path / f"{name}.log").open("wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, str(SCRIPT), str(spec_path)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        self._wait(0, ENGINES)

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]

    def _wait(self, n: int, names: tuple[str, ...]) -> None:
        deadline = time.monotonic() + WAIT_S
        for name in names:
            done = self.control / f"{name}.done.{n}"
            while not done.exists():
                assert self.procs[name].poll() is None, f"engine {name} exited:\n{self.log(name)}"
                assert time.monotonic() < deadline, f"engine {name}: command {n} not done in {WAIT_S} s"
                self.sub.poll(100)
            self.results[name] = json.loads(done.read_text())

    def run(self, commands: dict[str, dict[str, Any]]) -> None:
        """Give each named engine its command (the others an empty churn), wait until all are done, then
        until the subscriber holds every batch they published."""
        self.num_commands += 1
        n = self.num_commands
        for name in ENGINES:
            command = commands.get(name, {"op": "churn", "prompts": []})
            write_json_whole(self.control / f"{name}.cmd.{n}", command)
        self._wait(n, ENGINES)
        deadline = time.monotonic() + WAIT_S
        while any(len(self.sub.batches[name]) < self.results[name]["batches"] for name in ENGINES):
            assert time.monotonic() < deadline, "the subscriber never got every batch"
            self.sub.poll(100)

    def exit(self) -> None:
        self.num_commands += 1
        for name in ENGINES:
            write_json_whole(self.control / f"{name}.cmd.{self.num_commands}", {"op": "exit"})
        for name, proc in self.procs.items():
            assert proc.wait(WAIT_S) == 0, self.log(name)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _view(batches: list[tuple[int, Any]]) -> tuple[set[Any], set[Any], int]:
    """(the blocks the ``STORAGE`` events leave stored, every block published as stored, ``BlockRemoved``
    events), applying the batches in sequence order; ``AllBlocksCleared`` empties the view."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    assert [seq for seq, _ in batches] == list(range(len(batches))), "batches lost or reordered"
    view: set[Any] = set()  # vLLM's ExternalBlockHash: our block hashes (bytes)
    ever: set[Any] = set()
    num_removed = 0
    for _seq, batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                view.clear()
            elif isinstance(event, BlockStored) and event.medium == "STORAGE":
                view.update(event.block_hashes)
                ever.update(event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium == "STORAGE":
                view.difference_update(event.block_hashes)
                num_removed += 1
    return view, ever, num_removed


def _check(engines: _Engines, listed: set[bytes]) -> dict[str, Any]:
    """Per engine: its view is in the store, and is the store's listing of what it stored. Figures."""
    figures: dict[str, Any] = {"listed": len(listed)}
    for name in ENGINES:
        view, ever, num_removed = _view(engines.sub.batches[name])
        assert view <= listed, f"{name}: the events name {len(view - listed)} blocks the store does not hold"
        assert view == listed & ever, (
            f"{name}: {len(listed & ever - view)} stored blocks missing from its view"
        )
        figures[name] = {
            "batches": len(engines.sub.batches[name]),
            "stored_ever": len(ever),
            "removed_events": num_removed,
            "view": len(view),
            **engines.results[name],
        }
    return figures


def test_the_events_view_equals_the_shared_store_under_eviction(tmp_path: Path) -> None:
    model = build_tiny_model("llama", DEFAULT_MODELS_DIR)
    store_url = f"file://{tmp_path / 'store'}?capacity={CAPACITY}"
    sub = _Subscriber()
    engines: _Engines | None = None
    try:
        engines = _Engines(tmp_path, sub, {"model": str(model), "store": store_url, "endpoint": sub.endpoint})
        engines.run({name: {"op": "churn", "prompts": _prompts(seed)} for seed, name in enumerate(ENGINES)})
        engines.run({"a": {"op": "churn", "prompts": _prompts(9)[:2]}})  # in the store at the checkpoint
        engines.run({name: {"op": "flush"} for name in ENGINES})
        first = _check(engines, _listing(store_url))

        engines.run({"b": {"op": "churn", "prompts": _prompts(7)}})  # a puts nothing meanwhile
        engines.run({name: {"op": "flush"} for name in ENGINES})
        second = _check(engines, _listing(store_url))
        engines.exit()
    finally:
        if engines is not None:
            engines.kill()
        sub.close()
    print("kv events figures:", json.dumps({"after both churned": first, "after b churned": second}))
    for name in ENGINES:
        assert first[name]["removed_events"] > 0, f"{name}: no eviction reached its events"
    assert first["a"]["view"] >= 2 * PROMPT_BLOCKS
    assert first["a"]["view"] > second["a"]["view"], "a never learnt of b's evictions of its blocks"
    assert second["a"]["removed_events"] > first["a"]["removed_events"]
