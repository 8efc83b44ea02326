"""The CPUs the worker half's own threads run on (``worker_cpus``).

On CPU hosts vLLM binds each worker's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by
default): it hands the worker process one of ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY`` (``proclist=[...]``) or
``OMP_PLACES``, and the OpenMP runtime pins the process's main thread to the first of those cores. A thread
inherits the affinity of the thread that starts it, so without this module every thread the connector
starts from the main thread (the load thread, its readers, the save thread, and the threads those start)
would share that one core with the model's main compute thread. vLLM also leaves cores out of the OpenMP
binding on purpose: one per rank for the engine's front end and, when a KV connector is configured, one more
per rank for the connector (``vllm.utils.ompmultiprocessing``; none on a host too small to spare them).

``inherit`` (the default) leaves the connector's threads where they start. ``auto`` moves them to the CPUs
the worker process was started with that its OpenMP threads are not bound to -- the cores vLLM reserved,
which the engine's front end (and whatever else the host runs there) shares -- and leaves them where they
are when there is no such CPU or no OpenMP binding is in effect (GPU workers, in-process engines). A CPU
list (``"14,15"``, ``"12-15"``) pins them there. Which is faster depends on how busy those cores are
(docs/operations.md, "CPU hosts: where the connector's threads run"), so nothing moves unless asked.

The CPUs the worker process was started with are its parent's (vLLM's engine process, which spawns the
workers and binds nothing); reading the worker's own main thread would give the core OpenMP pinned it to.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog
from hybridkv.connector.config import parse_cpu_list

log = structlog.get_logger(__name__)

_PLACE_RE = re.compile(r"^(\d+)(?::(\d+)(?::(\d+))?)?$")
_PROCLIST_RE = re.compile(r"proclist=\[([^\]]*)\]")


def _parse_places(text: str) -> frozenset[int]:
    """The CPUs of an ``OMP_PLACES`` list of explicit places (``{0,1},{2:2}``, ``{lower:length[:stride]}``);
    ``ValueError`` for the abstract names (``cores``, ``threads``, ...) and place intervals."""
    cpus: set[int] = set()
    places = re.findall(r"\{([^}]*)\}", text)
    if not places or re.sub(r"\{[^}]*\}", "", text).strip(" ,"):
        raise ValueError(f"OMP_PLACES={text!r} is not a list of explicit places")
    for place in places:
        for item in place.split(","):
            match = _PLACE_RE.match(item.strip())
            if match is None:
                raise ValueError(f"OMP_PLACES={text!r}: {item!r} is not a CPU id or lower:length[:stride]")
            lower = int(match.group(1))
            length = int(match.group(2)) if match.group(2) is not None else 1
            stride = int(match.group(3)) if match.group(3) is not None else 1
            cpus.update(lower + index * stride for index in range(length))
    return frozenset(cpus)


def openmp_bound_cpus(environ: Mapping[str, str]) -> frozenset[int] | None:
    """The CPUs this process's OpenMP threads are bound to, from the variables vLLM's CPU backend sets
    (``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY``'s ``proclist``, ``OMP_PLACES`` with ``OMP_PROC_BIND``), or
    ``None`` when none is set or it cannot be read (then nothing is known to be bound)."""
    try:
        if environ.get("GOMP_CPU_AFFINITY", "").strip():
            return parse_cpu_list(environ["GOMP_CPU_AFFINITY"])
        proclist = _PROCLIST_RE.search(environ.get("KMP_AFFINITY", ""))
        if proclist is not None:
            return parse_cpu_list(proclist.group(1))
        bind = environ.get("OMP_PROC_BIND", "").strip().lower()
        if environ.get("OMP_PLACES", "").strip() and bind not in ("", "false"):
            return _parse_places(environ["OMP_PLACES"])
    except ValueError as error:
        log.warning(
            "hybridkv: OpenMP binding not understood; worker threads stay where they start", error=str(error)
        )
    return None


@dataclass(frozen=True)
class WorkerCpus:
    """Where the worker's threads run: ``cpus`` (``None``: where they start) and why."""

    cpus: frozenset[int] | None
    reason: str

    def pin_current_thread(self) -> None:
        """Move the calling thread to ``cpus`` (a thread's affinity, inherited by the threads it starts);
        a no-op for ``None``. Never raises: a refused move (a CPU taken away since start) leaves the thread
        where it is, which costs speed only."""
        if self.cpus is None:
            return
        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as error:
            log.warning("hybridkv: could not move a worker thread", cpus=sorted(self.cpus), error=str(error))

    def run_pinned(self, target: Callable[[], None]) -> Callable[[], None]:
        """``target`` wrapped to run on ``cpus`` (for ``threading.Thread(target=...)``)."""

        def run() -> None:
            self.pin_current_thread()
            target()

        return run


def resolve_worker_cpus(
    setting: str | frozenset[int],
    *,
    environ: Mapping[str, str],
    started_with: frozenset[int],
    allowed_now: frozenset[int],
) -> WorkerCpus:
    """Resolve ``worker_cpus``: ``setting`` is ``"auto"``, ``"inherit"`` or a CPU set; ``started_with`` the
    CPUs the worker process was started with, ``allowed_now`` the calling thread's own. A CPU set must lie
    within ``started_with | allowed_now`` (``ValueError`` naming the key and the CPUs that are not)."""
    if setting == "inherit":
        return WorkerCpus(None, "worker_cpus is inherit")
    usable = started_with | allowed_now
    if isinstance(setting, frozenset):
        outside = sorted(setting - usable)
        if outside:
            raise ValueError(
                f"kv_connector_extra_config['worker_cpus']: CPU(s) {outside} are not among this worker's "
                f"{sorted(usable)}"
            )
        return WorkerCpus(setting, "worker_cpus lists them")
    bound = openmp_bound_cpus(environ)
    if bound is None:
        return WorkerCpus(None, "no OpenMP binding in effect")
    spare = usable - bound
    if not spare:
        return WorkerCpus(None, f"every CPU of this worker ({sorted(usable)}) runs an OpenMP thread")
    return WorkerCpus(frozenset(spare), f"the CPUs outside the OpenMP binding {sorted(bound)}")


def worker_cpus_for(setting: str | frozenset[int]) -> WorkerCpus:
    """:func:`resolve_worker_cpus` for this process, logged once (INFO) with what it chose and why. The
    CPUs it was started with are its parent's (see the module docstring), or the calling thread's own where
    the parent's cannot be read."""
    allowed_now = frozenset(os.sched_getaffinity(0))
    try:
        started_with = frozenset(os.sched_getaffinity(os.getppid()))
    except OSError:
        started_with = allowed_now
    resolved = resolve_worker_cpus(
        setting, environ=os.environ, started_with=started_with, allowed_now=allowed_now
    )
    log.info(
        "hybridkv: worker threads",
        cpus="where they start" if resolved.cpus is None else sorted(resolved.cpus),
        reason=resolved.reason,
    )
    return resolved
