"""``kv_connector_extra_config`` of ``HybridStoreConnector``: parsed and validated once, at engine start.

Keys (all optional):

==================  =====================================================================================
``store``           store URL (``file://``, ``memory://``, ``mooncake://``, ``faulty+...``). Default: the
                    embedded file store under ``$XDG_CACHE_HOME/hybridkv/store`` (``~/.cache`` when unset).
``namespace``       key namespace; default derived from the model (its folder name). Letters, digits and
                    ``._-`` only, at most 64 characters.
``audit_log``       path of a JSON-lines audit file for state transitions, or ``null`` (no file).
``put_wave_bytes``  bytes of one PUT wave per rank (int, or a size like ``"64MiB"``: binary ``KiB``/``MiB``,
                    decimal ``KB``/``MB``, a bare ``64m`` is rejected as ambiguous); > 0 and at most
                    16 GiB (``MAX_PUT_WAVE_BYTES``: a CUDA worker pins three slabs of one wave at start).
                    At most four waves' bytes are queued per rank; a save beyond that is dropped and counted.
``lookup_budget_ms``  the most store time one lookup may take (lookups run off the scheduler thread); > 0
                    and at most 2**31 - 1 (about 24.8 days).
``verify_checksums``  verify value checksums on load (bool).
``load_mode``       ``"async"`` (default): a hit waits for its whole load before it is scheduled.
                    ``"layerwise"``: the hit is scheduled at once and its load overlaps the step's forward
                    (``start_load_kv`` starts it, each attention layer waits for its own pages); only for
                    models with one attention KV cache group and with async scheduling off (checked at
                    engine start, see ``connector.check_layerwise_supported``).
``cuda_copy``       how batches cross PCIe on CUDA KV caches: ``"auto"`` (default): by DMA from device staging
                    chunks that the copy kernel packs (saves) or unpacks (loads), one to three launches per
                    chunk; ``"kernel"``: every batch by one copy kernel launch straight between the pages
                    and pinned host memory; ``"dma"``: by DMA from chunks packed by one ``index_select`` /
                    ``index_copy_`` per layer tensor (no Triton). The kernel needs Triton and contiguous
                    pages (others take the ``dma`` path). Ignored for host caches. Why: see
                    docs/performance.md, "One copy kernel instead of packing plus DMA".
``weights_version`` a name for the weights this engine starts with (1-64 characters of ``A-Za-z0-9._-``,
                    or ``null``: the checkpoint's identity alone). It joins the key fingerprint until the
                    first connector reset. A reset (``reset_prefix_cache(reset_connector=True)``, and
                    vLLM's other callers: ``pause_generation(clear_cache=True)``, ``sleep``, ...) may
                    follow a weight update or not, so after it the keys name the weights by
                    ``weights_version_file`` only; without one they are private to this engine (a fresh
                    nonce per reset) until restart. Never a count of resets.
``weights_version_file``  path of a file holding the name of the weights this engine holds now (one line,
                    the rules of ``weights_version``), or ``null``. Read at every connector reset (never at
                    start: a restarted engine holds its checkpoint's weights, whatever the file says): its
                    name becomes the weights tag, the same on every engine whose file names the same
                    weights; an unchanged name keeps the keys. Missing, unreadable, not a valid name, or
                    not read within 1 s: the keys go private to this engine.
                    Write it after this engine's weights changed and before the reset that follows.
``divergent_local_hits``  (bool, default false) let vLLM keep a full-attention local hit whose recurrent
                    (Mamba / linear-attention) state at that depth is not local, and complete it from the
                    store: the request then loads only the tokens past the local full-attention hit and the
                    state at the hit's end. Only where every KV cache group is full attention or recurrent
                    (with a sliding-window group it stays off). A trade: when the store holds nothing past
                    the local full-attention hit, vLLM falls back to the prefix every group agrees on and
                    the store is not asked again, so what it holds below that hit is recomputed (see
                    docs/failure-semantics.md, "Divergent local hits").
``lookup_process``  (bool, default false) run the lookups (their searches and the store's existence calls)
                    in a process of the connector's own instead of a thread of the engine's, so that they
                    never hold the interpreter lock vLLM's scheduler needs
                    (``hybridkv.connector.scheduler.lookup_process``). Needs a store other processes can open
                    (``file://``, ``mooncake://``); ``memory://`` is refused.
``worker_cpus``     the CPUs of the worker half's own threads (load, readers, save): ``"inherit"`` (default):
                    where they start (on a CPU host whose vLLM binds OpenMP, the OpenMP main thread's
                    core); ``"auto"``: where vLLM binds OpenMP, the worker's CPUs outside that binding
                    (the cores vLLM reserves, one per rank for a KV connector), else where they start; or
                    a CPU list (``"14,15"``, ``"12-15"``) that the worker may use (checked at worker
                    start). See ``hybridkv.connector.worker.cpus``.
``step_trace``      (bool, default false) log one DEBUG event per scheduler step (``hybridkv step``: the
                    requests it asked again, answered, sent loads for, saw loads finish for and scheduled,
                    with ``time.monotonic()``, the audit log's clock), to trace where a hit's time to first
                    token goes (``hybridkv.connector.scheduler.step_trace``).
==================  =====================================================================================

An unknown key or a bad value raises ``ValueError`` naming the key and the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.key_grammar import NAMESPACE_RE
from hybridkv.store.base import StoreError
from hybridkv.store.params import (
    MAX_BYTE_SIZE,
    MAX_DURATION_MS,
    byte_size,
    did_you_mean,
    format_size,
)
from hybridkv.store.url import FAULTY_PREFIX, check_store_url, known_schemes, store_kind

DEFAULT_CAPACITY = "8GiB"
DEFAULT_PUT_WAVE_BYTES = 64 << 20
#: The largest ``put_wave_bytes``. A CUDA worker pins ``STAGING_SLABS`` (3) slabs of one wave each when it
#: registers its KV caches, and its host path pools as much, per rank: at 16 GiB that is already 48 GiB of
#: pinned host memory per GPU (384 GiB on an 8-GPU host), and a larger wave buys nothing (the default 64 MiB
#: keeps PCIe busy, docs/performance.md). A fixed cap, not a share of this host's memory: the scheduler and
#: every worker (other hosts, under multi-node TP) validate one config and must agree, and a value within the
#: cap that the host cannot pin still fails at the worker's allocation. Beyond the cap (e.g. 2**62, which
#: int64 holds) the engine stops at start naming the key, instead of at the worker's pinned allocation.
MAX_PUT_WAVE_BYTES = 16 << 30
#: Lookups run off the scheduler thread, so the budget bounds one request's wait for its answer, never the
#: scheduler: generous enough that a busy host's first (cold) existence check is not read as a dead store.
DEFAULT_LOOKUP_BUDGET_MS = 200.0

KNOWN_KEYS: tuple[str, ...] = (
    "store",
    "namespace",
    "audit_log",
    "put_wave_bytes",
    "lookup_budget_ms",
    "verify_checksums",
    "load_mode",
    "cuda_copy",
    "weights_version",
    "weights_version_file",
    "divergent_local_hits",
    "lookup_process",
    "step_trace",
    "worker_cpus",
)

#: values of ``load_mode``
LOAD_MODES: tuple[str, ...] = ("async", "layerwise")

#: ``cuda_copy`` -> the directions ("save": device -> host, "load": host -> device) the copy kernel moves
#: straight between the pages and pinned host memory (the others go by DMA from device staging)
CUDA_COPY_DIRECTIONS: dict[str, frozenset[str]] = {
    "auto": frozenset(),
    "kernel": frozenset({"save", "load"}),
    "dma": frozenset(),
}
#: ``cuda_copy`` -> whether the DMA path's staging chunks are packed by the copy kernel (else one
#: ``index_select`` / ``index_copy_`` per layer tensor per chunk)
CUDA_COPY_PACKS: dict[str, bool] = {"auto": True, "kernel": True, "dma": False}


def default_store_url() -> str:
    """The embedded file store in the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return f"file://{Path(base) / 'hybridkv' / 'store'}?capacity={DEFAULT_CAPACITY}"


def default_namespace(model: str) -> str:
    """A namespace from the model name or path: its last component, sanitized."""
    base = model.rstrip("/").split("/")[-1] or "model"
    ns = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip("._-")[:64]
    return ns or "model"


def parse_size(key: str, value: object, *, most: int = MAX_BYTE_SIZE) -> int:
    """Bytes from an int or a size string (``hybridkv.store.params.byte_size``: ``64MiB`` = 2**26,
    ``64MB`` = 64 * 10**6, a bare ``64m`` is rejected as ambiguous), in ``[1, most]``; raises ``ValueError``
    naming ``key`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"kv_connector_extra_config[{key!r}]: expected a byte size, got {value!r}")  # noqa: TRY004
    if isinstance(value, int):
        num_bytes = value
    else:
        try:
            num_bytes = byte_size(value)
        except ValueError as error:
            raise ValueError(
                f"kv_connector_extra_config[{key!r}]: bad byte size {value!r}: {error}"
            ) from None
    if num_bytes <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}]: must be > 0, got {value!r}")
    bound = min(most, MAX_BYTE_SIZE)
    if num_bytes > bound:
        shown = "8 EiB - 1" if bound == MAX_BYTE_SIZE else format_size(bound)
        raise ValueError(
            f"kv_connector_extra_config[{key!r}]: must be at most {bound} ({shown}), got {value!r}"
        )
    return num_bytes


def _audit_log_path(audit_log: object) -> str | None:
    """``audit_log`` checked: the expanded path, or None; raises ``ValueError`` naming the key."""
    if audit_log is None:
        return None
    if not isinstance(audit_log, (str, os.PathLike)) or not str(audit_log) or "\0" in str(audit_log):
        raise ValueError(
            f"kv_connector_extra_config['audit_log']: expected a path or null, got {audit_log!r}"
        )
    try:
        path = Path(audit_log).expanduser()
        os.fsencode(path)  # a lone surrogate no file name can hold: UnicodeEncodeError
        parent_is_dir, is_dir = path.parent.is_dir(), path.is_dir()
    # "~nosuchuser/..." (no home: RuntimeError), a name too long for the OS, a bytes path-like (TypeError)
    except (RuntimeError, OSError, ValueError, TypeError) as error:
        raise ValueError(f"kv_connector_extra_config['audit_log']: bad path {audit_log!r}: {error}") from None
    if not parent_is_dir:
        raise ValueError(f"kv_connector_extra_config['audit_log']: directory of {audit_log!r} does not exist")
    if is_dir:
        raise ValueError(f"kv_connector_extra_config['audit_log']: {audit_log!r} is a directory, not a file")
    return str(path)


def _weights_version_file(value: object) -> str | None:
    """``weights_version_file`` checked: the expanded path, or None; raises ``ValueError`` naming the key.
    The file itself need not exist yet (it is read at resets); its directory must."""
    if value is None:
        return None
    key = "kv_connector_extra_config['weights_version_file']"
    if not isinstance(value, (str, os.PathLike)) or not str(value) or "\0" in str(value):
        raise ValueError(f"{key}: expected a path or null, got {value!r}")
    try:
        path = Path(value).expanduser()
        os.fsencode(path)
        parent_is_dir, is_dir = path.parent.is_dir(), path.is_dir()
    except (RuntimeError, OSError, ValueError, TypeError) as error:
        raise ValueError(f"{key}: bad path {value!r}: {error}") from None
    if not parent_is_dir:
        raise ValueError(f"{key}: directory of {value!r} does not exist")
    if is_dir:
        raise ValueError(f"{key}: {value!r} is a directory, not a file")
    return str(path)


#: ``worker_cpus`` values that are not CPU lists
WORKER_CPUS_MODES: tuple[str, ...] = ("auto", "inherit")
#: the largest CPU id a list may name (Linux's largest ``NR_CPUS``)
MAX_CPU_ID = 8191
_CPU_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids of a list like ``"0,2,4-7"`` or ``"0 1 2"`` (also ``a-b:stride``); ``ValueError`` naming the
    bad item, for an empty list, or for an id above :data:`MAX_CPU_ID`."""
    cpus: set[int] = set()
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        match = _CPU_RANGE_RE.match(item)
        if match is None:
            raise ValueError(f"{item!r} is not a CPU id or a range a-b")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        stride = int(match.group(3)) if match.group(3) is not None else 1
        if high < low or stride < 1:
            raise ValueError(f"{item!r} is an empty range")
        if high > MAX_CPU_ID:
            raise ValueError(f"{item!r} names a CPU above {MAX_CPU_ID}")
        cpus.update(range(low, high + 1, stride))
    if not cpus:
        raise ValueError("no CPU named")
    return frozenset(cpus)


def _worker_cpus(value: object) -> str | frozenset[int]:
    """``worker_cpus`` checked: a mode of ``WORKER_CPUS_MODES`` or a CPU list; raises ``ValueError`` naming it."""
    if isinstance(value, str) and value in WORKER_CPUS_MODES:
        return value
    problem = f'expected one of {list(WORKER_CPUS_MODES)} or a CPU list like "14,15" or "12-15"'
    if isinstance(value, str):
        try:
            return parse_cpu_list(value)
        except ValueError as error:
            problem += f" ({error})"
    raise ValueError(f"kv_connector_extra_config['worker_cpus']: {problem}, got {value!r}")


def _lookup_budget_ms(budget: object) -> float:
    """``lookup_budget_ms`` checked (a number in (0, ``MAX_DURATION_MS``]); raises ``ValueError`` naming it."""
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and 0 < budget <= MAX_DURATION_MS:
        return float(budget)  # also refuses NaN and infinity: no comparison holds for NaN
    raise ValueError(
        f"kv_connector_extra_config['lookup_budget_ms']: expected a number > 0 and at most {MAX_DURATION_MS}, "
        f"got {budget!r}"
    )


@dataclass(frozen=True)
class ConnectorConfig:
    """The validated connector configuration (identical on the scheduler and every worker)."""

    store: str
    namespace: str
    audit_log: str | None
    put_wave_bytes: int
    lookup_budget_ms: float
    verify_checksums: bool
    load_mode: str = "async"
    cuda_copy: str = "auto"
    weights_version: str = ""
    weights_version_file: str | None = None
    divergent_local_hits: bool = False
    lookup_process: bool = False
    step_trace: bool = False
    #: ``"auto"``, ``"inherit"`` or the CPU ids of a list (``hybridkv.connector.worker.cpus``)
    worker_cpus: str | frozenset[int] = "inherit"

    @property
    def layerwise(self) -> bool:
        """Loads overlap the forward of the step that uses them (``load_mode: layerwise``)."""
        return self.load_mode == "layerwise"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, *, model: str) -> ConnectorConfig:
        """Validate ``kv_connector_extra_config``; ``model`` names the default namespace."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(
                f"kv_connector_extra_config: expected a JSON object of key: value, got {type(extra).__name__} "
                f"{extra!r}"
            )
        extra = dict(extra or {})
        # Keys of any type (a Python caller's dict may hold non-strings): sorted by their text.
        unknown = sorted(set(extra) - set(KNOWN_KEYS), key=repr)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown key(s) {unknown} (value(s) "
                f"{[extra[k] for k in unknown]!r}); known keys: {list(KNOWN_KEYS)}"
                + did_you_mean([key for key in unknown if isinstance(key, str)], KNOWN_KEYS)
            )

        store = extra.get("store")
        if store is None:
            store = default_store_url()
        if not isinstance(store, str):
            schemes = [f"{scheme}://" for scheme in known_schemes()] + [FAULTY_PREFIX]
            raise ValueError(  # noqa: TRY004 -- every configuration error is a ValueError naming its key
                f"kv_connector_extra_config['store']: expected a URL starting with one of {schemes}, "
                f"got {store!r}"
            )
        try:
            # Every part, opening nothing (the store opens later, on each role); an unknown scheme is named
            # with the known ones, a store plug-in's included (``hybridkv.store.plugins``).
            check_store_url(store)
        except StoreError as error:
            raise ValueError(f"kv_connector_extra_config['store']: {error}") from None

        namespace = extra.get("namespace")
        if namespace is None:
            namespace = default_namespace(model)
        if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(
                "kv_connector_extra_config['namespace']: expected 1-64 characters of [A-Za-z0-9._-] "
                "starting with a letter or digit, "
                f"got {namespace!r}"
            )

        audit_log = _audit_log_path(extra.get("audit_log"))

        put_wave_bytes = parse_size(
            "put_wave_bytes", extra.get("put_wave_bytes", DEFAULT_PUT_WAVE_BYTES), most=MAX_PUT_WAVE_BYTES
        )

        budget = _lookup_budget_ms(extra.get("lookup_budget_ms", DEFAULT_LOOKUP_BUDGET_MS))

        verify = _flag(extra, "verify_checksums", default=True)
        divergent_local_hits = _flag(extra, "divergent_local_hits", default=False)
        lookup_process = _flag(extra, "lookup_process", default=False)
        step_trace = _flag(extra, "step_trace", default=False)
        if lookup_process and store_kind(store).process_local:
            raise ValueError(
                f"kv_connector_extra_config['lookup_process']: {lookup_process!r} needs a store another process can open "
                f"(file://, mooncake://); {store!r} lives in this process only"
            )

        load_mode = extra.get("load_mode", "async")
        if load_mode not in LOAD_MODES:
            raise ValueError(
                f"kv_connector_extra_config['load_mode']: expected one of {list(LOAD_MODES)}, got {load_mode!r}"
            )

        cuda_copy = extra.get("cuda_copy", "auto")
        if not isinstance(cuda_copy, str) or cuda_copy not in CUDA_COPY_DIRECTIONS:
            raise ValueError(
                f"kv_connector_extra_config['cuda_copy']: expected one of {list(CUDA_COPY_DIRECTIONS)}, "
                f"got {cuda_copy!r}"
            )

        weights_version = extra.get("weights_version")
        if weights_version is not None and (
            not isinstance(weights_version, str) or not NAMESPACE_RE.fullmatch(weights_version)
        ):
            raise ValueError(
                "kv_connector_extra_config['weights_version']: expected null or 1-64 characters of "
                f"[A-Za-z0-9._-] starting with a letter or digit, got {weights_version!r}"
            )

        weights_version_file = _weights_version_file(extra.get("weights_version_file"))

        worker_cpus = _worker_cpus(extra.get("worker_cpus", "inherit"))

        return cls(
            store=store,
            namespace=namespace,
            audit_log=audit_log,
            put_wave_bytes=put_wave_bytes,
            lookup_budget_ms=budget,
            verify_checksums=verify,
            load_mode=load_mode,
            cuda_copy=cuda_copy,
            weights_version=weights_version or "",
            weights_version_file=weights_version_file,
            divergent_local_hits=divergent_local_hits,
            lookup_process=lookup_process,
            step_trace=step_trace,
            worker_cpus=worker_cpus,
        )


def _flag(extra: Mapping[str, Any], key: str, *, default: bool) -> bool:
    """The boolean ``extra[key]`` (``default`` when absent); ``ValueError`` naming the key otherwise."""
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(  # noqa: TRY004 -- every configuration error is a ValueError naming its key
            f"kv_connector_extra_config[{key!r}]: expected true or false, got {value!r}"
        )
    return value
