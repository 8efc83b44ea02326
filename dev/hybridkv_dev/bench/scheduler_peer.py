"""vLLM's in-tree ``MooncakeStoreConnector`` as the peer of ``hybridkv bench scheduler``.

The peer's scheduler half (``MooncakeStoreScheduler``, built by vLLM's ``Scheduler`` in the bench process like
hybridkv's) does not look anything up itself: ``get_num_new_matched_tokens`` sends the request's block hashes
over ZMQ (``LookupKeyClient``, a REQ socket on an IPC path) to the ``LookupKeyServer`` (REP) that the peer's
worker of rank 0 runs, and that worker builds every candidate key (every hash unit x KV-cache group x rank
namespace) and asks its Mooncake client one ``batch_is_exist``. With ``lookup_async`` false (the default) the
scheduler thread waits for the answer; with ``lookup_async`` true it submits the lookup and answers "not yet"
(``None``) until the answer is there, asking again every step. vLLM 0.34 adds lookup prefetch
(``lookup_prefetch_limit`` > 0, with ``lookup_async``): ``on_new_request`` submits the lookup when the request
arrives, and the first ``get_num_new_matched_tokens`` reuses it.

:class:`PeerLookupServer` is that worker of rank 0, in a spawned child process (as vLLM's worker is its own
process; the child's Python work then never competes with the scheduler thread for the GIL): vLLM's own
``MooncakeStoreWorker.__init__`` with the tensor / decode-context parallel group getters answering for rank 0
of the bench's TP 8 x DCP 8 (no ``torch.distributed``), so its key namespaces, coordinator, lookup and
``LookupKeyServer`` are the peer's own code; its ``MooncakeDistributedStore`` is a real client (embedded
segment, TCP, P2PHANDSHAKE) of the bench's ``mooncake_master``. It registers no KV caches: a lookup needs
none. :meth:`PeerLookupServer.plant` puts a dummy value under the peer's own key strings
(``PoolKey.build_key_string`` of the worker's lookup key prefixes, the same prefixes its lookup checks) for
each (KV-cache group, boundary) of a stored prefix: what a previous request saved, in the peer's format.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

from hybridkv_dev.devkit.net import LOOPBACK, NETNS_HINT, loopback_only_namespace

__all__ = [
    "PEER_CONNECTOR",
    "PeerLookupServer",
    "peer_hits_and_loads",
    "peer_lookup_server",
    "peer_report_saves_done",
    "peer_unavailable_reason",
]

PEER_CONNECTOR = "MooncakeStoreConnector"
_START_TIMEOUT_S = 120.0  # the child imports vLLM and starts a Mooncake client (slow on a busy 2-core host)
_CALL_TIMEOUT_S = 120.0
_PUT_BATCH = 512


def peer_unavailable_reason() -> str | None:
    """Why the peer cannot run here (``None`` when it can): the Mooncake wheel, and a loopback-only network
    namespace (its clients listen on 0.0.0.0)."""
    if importlib.util.find_spec("mooncake") is None:
        return "the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as error:
        return f"mooncake.store does not import ({error})"
    if not loopback_only_namespace():
        return NETNS_HINT
    return None


def peer_transfer_config(lookup_rpc_port: int, *, lookup_async: bool, prefetch_limit: int = 0) -> Any:
    """The peer's ``KVTransferConfig``: kv_both, its defaults (``load_async`` true), the lookup mode, and a
    lookup IPC name of this bench's own (``lookup_rpc_port`` only names the IPC path). ``prefetch_limit``
    (vLLM 0.34, with ``lookup_async``): ``lookup_prefetch_limit``, lookups started when a request arrives
    (``on_new_request``), at most that many in flight; 0 leaves the key out (off)."""
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"lookup_rpc_port": lookup_rpc_port, "lookup_async": lookup_async}
    if prefetch_limit:
        extra["lookup_prefetch_limit"] = prefetch_limit
    return KVTransferConfig(kv_connector=PEER_CONNECTOR, kv_role="kv_both", kv_connector_extra_config=extra)


def peer_hits_and_loads(meta: Any) -> tuple[int, set[str]]:
    """(hit tokens, request ids) of the loads in one step's ``MooncakeStoreConnectorMetadata``: each request
    whose load the scheduler accepted (``can_load``), with the store's hit length (``kvpool_cached_tokens``)."""
    hit_tokens = 0
    loads: set[str] = set()
    for req_meta in meta.requests:
        spec = req_meta.load_spec
        if spec is not None and spec.can_load:
            hit_tokens += spec.kvpool_cached_tokens
            loads.add(req_meta.req_id)
    return hit_tokens, loads


def peer_report_saves_done(connector: Any, meta: Any, num_workers: int) -> None:
    """Tell the peer's scheduler half that every rank finished the store jobs of ``meta``, as its workers'
    ``MooncakeStoreWorkerMetadata`` would (``update_connector_output``): it drops the block references each
    job holds. The bench runs no workers; without this the pinned blocks would fill the pool."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    done = {m.store_job_id: num_workers for m in meta.requests if m.store_job_id is not None}
    if done:
        worker_meta = MooncakeStoreWorkerMetadata(completed_saves=done)
        connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker_meta))


def close_peer_client(connector: Any) -> None:
    """Close the scheduler half's ``LookupKeyClient`` (vLLM never does; its context would block the
    interpreter's exit): let a lookup in flight finish, close the socket, end the ZMQ context."""
    client = connector.connector_scheduler.client
    client.executor.shutdown(wait=True)
    client.close()
    client.ctx.term()


class PeerLookupServer:
    """The peer's worker of rank 0 (``MooncakeStoreWorker`` with its ``LookupKeyServer``) in a spawned child.

    ``master_address``: the ``mooncake_master`` its store client talks to (e.g. a delay proxy in front of
    one). Use as a context manager or ``start`` / ``close``. ``transfer_config(lookup_async)`` gives the
    ``KVTransferConfig`` whose scheduler half reaches this server.
    """

    def __init__(
        self,
        master_address: str,
        models_dir: Path,
        *,
        segment_bytes: int = 64 << 20,
        log_dir: Path | None = None,
    ) -> None:
        self.master_address = master_address
        self.models_dir = models_dir
        self.segment_bytes = segment_bytes
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="hybridkv-sched-peer-"))
        self.lookup_rpc_port = 10000 + uuid.uuid4().int % 50000  # names the IPC path only
        self._process: Any = None
        self._conn: Any = None
        self.info: dict[str, Any] = {}

    @property
    def log_path(self) -> Path:
        return self.log_dir / "peer_worker.log"

    def transfer_config(self, *, lookup_async: bool, prefetch_limit: int = 0) -> Any:
        return peer_transfer_config(
            self.lookup_rpc_port, lookup_async=lookup_async, prefetch_limit=prefetch_limit
        )

    def start(self) -> PeerLookupServer:
        """Spawn the child and wait until its lookup server listens; ``RuntimeError`` (naming the log)
        when it fails or does not come up within ``_START_TIMEOUT_S``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.log_dir / "mooncake_store_connector.json"
        config_path.write_text(
            json.dumps(
                {
                    "mode": "embedded",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": self.master_address,
                    "global_segment_size": self.segment_bytes,
                    "local_buffer_size": 16 << 20,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_peer_worker_child,
            args=(
                child_conn,
                str(self.models_dir),
                self.lookup_rpc_port,
                str(config_path),
                str(self.log_path),
            ),
            name="hybridkv-bench-scheduler-peer-worker",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        reply = self._receive(_START_TIMEOUT_S)
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"the peer's worker did not start: {reply[1]}; see {self.log_path}")
        self.info = reply[1]
        return self

    def _receive(self, timeout_s: float) -> Any:
        assert self._conn is not None
        if not self._conn.poll(timeout_s):
            return ("error", f"no answer within {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            return ("error", f"the child exited (code {self._process.exitcode})")

    def _call(self, *message: Any) -> Any:
        assert self._conn is not None, "the peer's worker is not running"
        self._conn.send(message)
        reply = self._receive(_CALL_TIMEOUT_S)
        if reply[0] != "ok":
            raise RuntimeError(f"the peer's worker failed {message[0]}: {reply[1]}; see {self.log_path}")
        return reply[1]

    def plant(self, prefixes: Sequence[tuple[Sequence[bytes], Sequence[tuple[int, int]]]]) -> int:
        """Store a dummy value under the peer's keys of every ``(group, boundary)`` of each
        ``(block hashes, entries)`` (boundaries in tokens, on hash units), on every rank namespace its lookup
        checks; returns the number of keys put."""
        items = [([bytes(h) for h in hashes], [tuple(e) for e in entries]) for hashes, entries in prefixes]
        return int(self._call("plant", items))

    def take_lookups(self) -> list[dict[str, float]]:
        """The lookups served since the last call: per lookup its candidate keys, the ``batch_is_exist``
        seconds and the worker's whole ``lookup`` seconds."""
        lookups: list[dict[str, float]] = self._call("lookups")
        return lookups

    def close(self) -> None:
        """Stop the child (it exits hard: the peer's ZMQ context would block its exit)."""
        if self._conn is not None:
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(("stop",))
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.join(15)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
            self._process = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def peer_lookup_server(master_address: str, models_dir: Path) -> Iterator[PeerLookupServer]:
    """A started :class:`PeerLookupServer` for the block."""
    with PeerLookupServer(master_address, models_dir) as server:
        yield server


# -- the child process ------------------------------------------------------------------------------------
class _TimedStore:
    """The worker's Mooncake client, timing ``batch_is_exist`` (the lookup's one store call)."""

    def __init__(self, inner: Any, calls: list[tuple[int, float]]) -> None:
        self._inner = inner
        self._calls = calls

    def batch_is_exist(self, keys: list[str]) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner.batch_is_exist(keys)
        finally:
            self._calls.append((len(keys), time.perf_counter() - t0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _peer_worker_child(
    conn: Any, models_dir: str, lookup_rpc_port: int, config_path: str, log_path: str
) -> None:
    """Child body: the peer's worker of rank 0, serving lookups (its own thread) and the parent's commands."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["MOONCAKE_CONFIG_PATH"] = config_path
    os.environ["VLLM_HOST_IP"] = LOOPBACK  # the transfer engine's advertised name: loopback
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        worker, key_prefixes, lookups = _start_peer_worker(Path(models_dir), lookup_rpc_port)
        info = {"key_prefixes": [list(p) for p in key_prefixes], "hash_unit": worker.hash_block_size}
        conn.send(("ready", info))
    except BaseException as error:  # noqa: BLE001 -- reported to the parent as text
        conn.send(("error", f"{type(error).__name__}: {error}"))
        sys.stdout.flush()
        os._exit(1)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] == "stop":
            break
        try:
            if message[0] == "plant":
                conn.send(("ok", _plant(worker, key_prefixes, message[1])))
            elif message[0] == "lookups":
                taken = lookups[:]
                del lookups[: len(taken)]
                conn.send(("ok", taken))
            else:
                conn.send(("error", f"unknown command {message[0]!r}"))
        except BaseException as error:  # noqa: BLE001 -- reported to the parent as text
            conn.send(("error", f"{type(error).__name__}: {error}"))
    # The server thread stays in its socket's receive (closing a socket under it is not safe): remove its
    # IPC name, unmount the segment, and exit hard.
    with contextlib.suppress(OSError):
        os.unlink(worker.lookup_server._ipc_path)
    with contextlib.suppress(Exception):
        worker.close()
    sys.stdout.flush()
    os._exit(0)


def _plant(worker: Any, key_prefixes: list[tuple[str, ...]], items: list[Any]) -> int:
    """Put a dummy value under every peer key of ``items`` ((block hashes, (group, boundary) entries))."""
    unit = worker.hash_block_size
    pool_key = _pool_key_class()
    keys = [
        pool_key.build_key_string(prefix, hashes[boundary // unit - 1].hex())
        for hashes, entries in items
        for group, boundary in entries
        for prefix in key_prefixes[group]
    ]
    for start in range(0, len(keys), _PUT_BATCH):
        batch = keys[start : start + _PUT_BATCH]
        code = worker.store.put_batch(batch, [b"k3"] * len(batch))
        if code != 0:
            raise RuntimeError(f"put_batch of {len(batch)} keys returned {code}")
    return len(keys)


def _pool_key_class() -> Any:
    """The peer's ``PoolKey`` (its key strings): ``store/data.py`` up to vLLM 0.33, ``store/layout.py`` in 0.34."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.layout import PoolKey
    except ImportError:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import PoolKey
    return PoolKey


def _start_peer_worker(
    models_dir: Path, lookup_rpc_port: int
) -> tuple[Any, list[tuple[str, ...]], list[Any]]:
    """vLLM's ``MooncakeStoreWorker`` as TP rank 0 of the bench's geometry, its lookups recorded."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module

    from hybridkv_dev.bench.scheduler import k3_configs

    vc, cfg = k3_configs(None, models_dir, transfer=peer_transfer_config(lookup_rpc_port, lookup_async=False))
    tp = vc.parallel_config.tensor_parallel_size
    dcp = vc.parallel_config.decode_context_parallel_size
    # Rank 0 of TP x DCP without torch.distributed: the worker reads only its rank and the group sizes.
    peer_worker: Any = worker_module  # its module globals, answered for this process only
    peer_worker.get_tensor_model_parallel_rank = lambda: 0
    peer_worker.get_tensor_model_parallel_world_size = lambda: tp
    peer_worker.get_pcp_group = lambda: SimpleNamespace(world_size=1, rank_in_group=0)
    peer_worker.get_dcp_group = lambda: SimpleNamespace(world_size=dcp, rank_in_group=0)
    worker: Any = peer_worker.MooncakeStoreWorker(vc, cfg)
    assert worker.lookup_server is not None, "rank 0 runs the lookup server"
    exists_calls: list[tuple[int, float]] = []
    lookups: list[Any] = []
    worker.store = _TimedStore(worker.store, exists_calls)
    lookup = worker.lookup

    def timed_lookup(num_tokens: int, block_hashes: Any) -> Any:
        t0 = time.perf_counter()
        del exists_calls[:]
        result = lookup(num_tokens, block_hashes)
        keys = sum(n for n, _ in exists_calls)
        exists_s = sum(s for _, s in exists_calls)
        lookups.append(
            {
                "keys": keys,
                "exists_calls": len(exists_calls),
                "exists_s": exists_s,
                "lookup_s": time.perf_counter() - t0,
                "hit_tokens": result.hit_length,
            }
        )
        return result

    worker.lookup = timed_lookup  # the LookupKeyServer calls store_worker.lookup
    return worker, list(worker._lookup_key_prefixes), lookups
