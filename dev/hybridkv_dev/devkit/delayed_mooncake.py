"""A real Mooncake deployment on loopback whose master is reached over a slow link (``DelayProxy``).

``delayed_mooncake_store(delay_ms)`` is a context manager that yields the ``mooncake://`` store URL an
engine (``open_store(url)``, the connector's ``store`` option) uses; ``delayed_mooncake(delay_ms)`` yields
the whole ``DelayedMooncake`` (the URL, the real master's address, the proxy's counters). Inside:

- a ``mooncake_master`` child on ``127.0.0.1`` (``hybridkv.store.mooncake_node.master_command``, as
  ``hybridkv mooncake master`` starts it);
- a storage node child (``python -m hybridkv.store.mooncake_node``) that mounts ``segment_bytes`` of DRAM and
  talks to the master directly;
- a ``DelayProxyProcess`` (``hybridkv_dev.devkit.delay_proxy``, in a child process of its own so that its
  threads never wait for the GIL of the process being measured) listening on ``127.0.0.1`` and forwarding
  to the master's RPC port with ``delay_ms`` one way, in each direction.

The URL names the proxy as the master and makes the engine a pure client (``segment=0``: it mounts nothing,
puts are placed on the storage node). Which links are delayed, for a client of that URL:

================================================  =========  ==============================================
link (TCP, all on 127.0.0.1)                      delayed    what travels on it
================================================  =========  ==============================================
engine client -> master RPC, via the proxy        yes        every master call: ``exists``
                                                             (``batch_is_exist``), put start and end, the
                                                             replica list before a get, removes, the
                                                             set-up call; one connection per client
engine client -> storage node transfer engine     no         the handshake and the bytes of puts and gets
storage node -> master RPC                        no         the node's mount and its heartbeats
metadata server                                   --         none: P2PHANDSHAKE (peers exchange segment
                                                             descriptors in the transfer handshake)
================================================  =========  ==============================================

(Checked with ``ss -tnp`` in the namespace: the engine's client has one connection to the proxy and none to
the master; an idle pure client sent nothing to the master in 6 s.) So an ``exists`` costs one master round
trip (>= ``2 x delay_ms`` more than without the proxy), a put two (start, end) plus the undelayed transfer,
a get one (replica list) plus the transfer; measured at ``delay_ms=5``: exists ~11 ms, put ~22 ms, get of
4 KiB ~12 ms. That is a store whose control plane is far away and whose data plane is near; ``tc netem`` on
``lo`` would delay every link, the transfers too.

Mooncake clients listen on ``0.0.0.0`` and cannot be told otherwise, so this refuses to start outside a
network namespace whose only interface is ``lo`` (``scripts/netns-run``): ``RuntimeError``.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybridkv.store.mooncake_node import READY_PREFIX, engine_store_url, node_command

from hybridkv_dev.devkit.delay_proxy import DelayProxyProcess, DelayProxyStats, read_child_line
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hybridkv_dev.devkit.net import NETNS_HINT, loopback_only_namespace

__all__ = [
    "DelayedMooncake",
    "delayed_mooncake",
    "delayed_mooncake_store",
]

HOST = "127.0.0.1"
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


@dataclass
class DelayedMooncake:
    """A running deployment (see the module docstring); valid inside its ``with`` block."""

    url: str
    """the store URL for engines: ``mooncake://<proxy>?segment=0&local_hostname=127.0.0.1&timeout_ms=...``"""
    master_address: str
    """the real master, ``127.0.0.1:PORT`` (undelayed: for processes that must not pay the delay)"""
    proxy_address: str
    """``127.0.0.1:PORT`` of the delay proxy in front of the master's RPC port"""
    storage_node_hostname: str
    """the storage node's segment name (its transfer engine's ``HOST:PORT``)"""
    delay_ms: float
    """one-way delay each direction of the master link pays"""
    log_dir: Path
    """the master's and the storage node's logs"""
    proxy_stats: DelayProxyStats | None = None
    """the proxy's counters, set when the block is left (``None`` before, or if the proxy died)"""


@contextmanager
def delayed_mooncake(
    delay_ms: float,
    *,
    segment_bytes: int = 256 << 20,
    timeout_ms: int = 2000,
    log_dir: Path | None = None,
) -> Iterator[DelayedMooncake]:
    """Start master, storage node and delay proxy; yield the deployment; stop all three on exit.

    ``timeout_ms`` is the URL's per-call deadline (also Mooncake's ``MC_RPC_TIMEOUT_MS`` when the first
    store this process opens sets it); it must cover a few round trips of ``2 x delay_ms``. ``log_dir``:
    where the master and node logs go (a fresh temporary directory by default, left for post-mortems).
    Raises ``RuntimeError`` outside a loopback-only namespace or when a process does not come up (with the
    log to read); ``ValueError`` for a negative delay.
    """
    if not delay_ms >= 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    if timeout_ms > 0 and timeout_ms < 4 * 2 * delay_ms:
        raise ValueError(f"timeout_ms {timeout_ms} is less than four round trips of {2 * delay_ms} ms")
    if not loopback_only_namespace():
        raise RuntimeError(f"the delayed Mooncake deployment: {NETNS_HINT}")
    logs = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="hybridkv-delayed-mooncake-"))
    logs.mkdir(parents=True, exist_ok=True)
    master = MooncakeMaster(logs / "mooncake_master.log", start_timeout_s=_START_TIMEOUT_S)
    master_address = master.address
    with ExitStack() as stack:
        stack.callback(master.stop)
        master.start()

        node_log = logs / "storage_node.log"
        node = _start_logged(
            node_command(master_address, HOST, segment_bytes=segment_bytes),
            node_log,
            stdout=subprocess.PIPE,
        )
        stack.callback(_stop, node)
        assert node.stdout is not None
        line = read_child_line(node.stdout, _START_TIMEOUT_S)
        if not line.startswith(READY_PREFIX + " "):
            raise RuntimeError(f"storage node did not mount its segment ({line!r}); see {node_log}")
        node_hostname = line.split()[1]

        proxy = DelayProxyProcess(master.rpc_port, delay_ms=delay_ms).start()
        deployment = DelayedMooncake(
            url=engine_store_url(proxy.address, HOST, timeout_ms=timeout_ms),
            master_address=master_address,
            proxy_address=proxy.address,
            storage_node_hostname=node_hostname,
            delay_ms=delay_ms,
            log_dir=logs,
        )

        def stop_proxy() -> None:
            deployment.proxy_stats = proxy.close()

        stack.callback(stop_proxy)
        yield deployment


@contextmanager
def delayed_mooncake_store(delay_ms: float, *, timeout_ms: int = 2000) -> Iterator[str]:
    """The store URL of a ``delayed_mooncake(delay_ms)`` deployment, for as long as the block runs.

    Every master RPC of a client of this URL pays ``delay_ms`` each way (``exists`` >= ``2 x delay_ms``);
    data transfers do not. Run under ``scripts/netns-run``. Close the stores opened on the URL before the
    block ends (a client whose master vanished waits for its RPC timeouts)."""
    with delayed_mooncake(delay_ms, timeout_ms=timeout_ms) as deployment:
        yield deployment.url


# -- child processes ------------------------------------------------------------------------------------
def _start_logged(argv: list[str], log_path: Path, *, stdout: int | None = None) -> subprocess.Popen[str]:
    """``argv`` with stderr (and stdout unless piped) appended to ``log_path``."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            argv,
            stdout=stdout if stdout is not None else log_file,
            stderr=log_file,
            text=True,
        )


def _stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``_STOP_TIMEOUT_S``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(_STOP_TIMEOUT_S)
    if process.stdout is not None:
        process.stdout.close()
