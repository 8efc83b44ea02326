"""``open_store(url)``: the one way to get a ``Store``.

=====================================================  =======================================================
URL                                                    parameters (all optional)
=====================================================  =======================================================
``memory://NAME``                                      ``capacity`` (LRU bound; default unbounded),
                                                       ``quotas`` (``NS:SIZE,...``: bytes per namespace)
``file:///ABS/DIR``                                    ``capacity`` (default 8GiB), ``timeout_ms`` (deadline
                                                       of each call; default 30000 where DIR is on a network
                                                       or FUSE file system, none on a local one; > 0)
``mooncake://HOST:PORT``                               ``metadata`` (``P2PHANDSHAKE``), ``local_hostname``
                                                       (127.0.0.1), ``segment`` (1GiB), ``local_buffer``
                                                       (64MiB), ``protocol`` (tcp; rdma is refused),
                                                       ``device`` (""),
                                                       ``timeout_ms`` (2000; > 0: every call has a deadline),
                                                       ``breaker_failures`` (1), ``breaker_reset_s`` (5),
                                                       ``preferred_segment`` (``local`` | ``none`` | HOST:PORT)
``SCHEME://...`` of a store plug-in                    its own (``hybridkv.store.plugins``: a package registers a
                                                       ``StoreKind`` under the ``hybridkv.stores`` entry point)
``faulty+<any of the above>``                          ``get_fail``, ``put_fail``, ``exists_fail``, ``corrupt``,
                                                       ``get_late``, ``put_late`` (probabilities),
                                                       ``delay_ms``, ``late_ms``, ``late_scribble``, ``seed``;
                                                       faults by position: ``{exists,get,put}_gap``,
                                                       ``_tail``, ``_random_gaps``, ``fail_after``,
                                                       ``fail_calls``, ``fail_ops``, scoped by
                                                       ``fault_group``, ``fault_tp_rank``, ``fault_dcp_rank``
=====================================================  =======================================================

Every scheme also takes ``checksum=xxh3|crc32|none|auto`` (default ``auto``: xxh3 when ``xxhash`` is
installed, else crc32), and, opt-in, an integrity key: ``integrity_key_file=/ABS/PATH`` or
``integrity_key_env=NAME`` (one of them) names a secret (one per line, the current one first, each at least
16 bytes) that seals every frame with a keyed hash, so that values written without it read ``CORRUPT``
(``hybridkv.store.integrity``; with a key, ``checksum=none`` is refused). Sizes accept ``4096``,
``64KiB`` (binary), ``2GB`` (decimal); a bare ``64m`` is rejected as ambiguous
(``hybridkv.store.params.byte_size``). Anything else -- an unknown scheme or parameter, a bad size, a
probability outside [0, 1], a missing directory or host, a fragment, a missing, unreadable or short key --
raises one ``StoreError`` that names the offending part. ``check_store_url(url)`` runs every one of those
checks and opens nothing (no directory, no connection; it does read the key): the connector's configuration
calls it at engine start.

Engines and operators: ``open_store(url)`` is an engine's (or a benchmark's) open: it creates a store that
does not exist yet and records in it what its engines run with (a file store's capacity,
``hybridkv.store.file.capacity``). ``open_store(url, operator=True)`` is an operator command's: it refuses a
URL that names no existing store (a mistyped path is an error, never an empty new store), records nothing,
and reads what the URL leaves out from that record (a file URL without ``capacity`` opens with the
capacity the engines recorded), so what it shows is what the engines run with.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlencode

from hybridkv.store.base import StoreError
from hybridkv.store.faulty import FAULTY_PARAMS, FaultyBackend
from hybridkv.store.file import DEFAULT_HANG_TIMEOUT_MS, FileBackend
from hybridkv.store.file.capacity import record_capacity, recorded_capacity
from hybridkv.store.frame import ChecksumAlgo, checksum_from_name
from hybridkv.store.framed import Backend, FramedStore
from hybridkv.store.integrity import Keyring, keyring_from_environment, keyring_from_file
from hybridkv.store.kinds import StoreKind, StoreTier
from hybridkv.store.memory import MemoryBackend
from hybridkv.store.params import MAX_DURATION_MS, Params, ParsedUrl, shown_url, split_url
from hybridkv.store.plugins import plugin_kinds
from hybridkv.store.quotas import check_quotas, parse_quotas

#: A file URL's capacity when it names none: the capacity of the connector's default store too
#: (``hybridkv.connector.config.DEFAULT_CAPACITY``), so that one default holds everywhere.
DEFAULT_FILE_CAPACITY = 8 << 30
#: A ``mooncake://`` master address: HOST:PORT with an ASCII port.
_MOONCAKE_PORT = re.compile(r"[0-9]{1,5}")
#: The prefix that wraps any store URL in the chaos view (``FaultyBackend``).
FAULTY_PREFIX = "faulty+"


def store_kind(url: str) -> StoreKind:
    """The kind of ``url``'s scheme (through any ``faulty+`` view): a built-in row or an installed plug-in's
    (``hybridkv.store.plugins``). ``StoreError`` if unknown, naming the known schemes, or if the plug-in that
    claims it is not served, saying why."""
    inner = url.removeprefix(FAULTY_PREFIX)
    scheme = inner.split("://", 1)[0] if "://" in inner else ""
    kind = STORE_KINDS.get(scheme)
    if kind is not None:
        return kind
    plugins = plugin_kinds(frozenset(STORE_KINDS))
    kind = plugins.scheme_to_kind.get(scheme)
    if kind is not None:
        return kind
    refusal = plugins.scheme_to_refusal.get(scheme)
    if refusal is not None:
        raise StoreError(f"store URL {shown_url(url)!r}: {refusal}")
    raise StoreError(
        f"store URL {shown_url(url)!r}: unknown scheme {scheme!r} (known: {', '.join(known_schemes())}, each "
        f"also as {FAULTY_PREFIX}<url>)"
    )


def known_schemes() -> list[str]:
    """Every scheme a store URL may name: the built-in ones, then the installed plug-ins' that are served."""
    return [*STORE_KINDS, *plugin_kinds(frozenset(STORE_KINDS)).scheme_to_kind]


def lookup_client_url(url: str) -> str:
    """The URL a lookup-only client of the same store opens: ``url`` with its kind's
    ``lookup_client_params`` set (replacing the URL's own values), everything else as it is."""
    overrides = store_kind(url).lookup_client_params
    if not overrides:
        return url
    base, _, query = url.partition("?")
    pairs = [pair for pair in query.split("&") if pair and pair.split("=", 1)[0] not in overrides]
    pairs += [f"{name}={value}" for name, value in overrides.items()]
    return f"{base}?{'&'.join(pairs)}"


def open_store(url: str, *, operator: bool = False) -> FramedStore:
    """Open the store ``url`` names (see the module docstring). Raises ``StoreError`` on any bad part.

    Without ``operator`` (an engine): a store that does not exist is created, and what its engines run with
    is recorded in it (``StoreKind.record``). With ``operator`` (a command that inspects or administers a
    store): a URL that names no existing store raises ``StoreError`` saying so, nothing is recorded, and
    parameters the URL leaves out are read from the record (``StoreKind.recorded_params``)."""
    if not isinstance(url, str) or not url:
        raise StoreError(f"store URL must be a non-empty string, got {url!r}")
    keyring = store_keyring(url)
    opener, checksum = _backend_opener(url, operator=operator)  # every part checked, nothing opened yet
    if operator:
        absent = absent_store(url)
        if absent is not None:
            raise StoreError(
                f"store URL {shown_url(url)!r}: {absent} (a mistyped path? this command creates no store)"
            )
    return FramedStore(opener(), checksum=checksum, keyring=keyring)


def check_store_url(url: str) -> None:
    """Check every part of ``url`` as ``open_store`` does, opening nothing (no directory is created, no
    connection made). Raises ``StoreError`` naming the bad part."""
    if not isinstance(url, str) or not url:
        raise StoreError(f"store URL must be a non-empty string, got {url!r}")
    _backend_opener(url)


def open_backend(url: str, *, operator: bool = False) -> tuple[Backend, ChecksumAlgo]:
    """The frame-moving backend for ``url`` and the checksum its frames use (``open_store`` minus framing;
    ``operator`` as there, without the check that the store exists)."""
    opener, checksum = _backend_opener(url, operator=operator)
    return opener(), checksum


def _backend_opener(url: str, *, operator: bool = False) -> tuple[Callable[[], Backend], ChecksumAlgo]:
    """``url`` checked: what opens its backend (and, unless ``operator``, records in the store what its
    engines run with), and the checksum its frames use."""
    if url.startswith(FAULTY_PREFIX):
        return _faulty_opener(url, operator=operator)
    parsed = split_url(url)
    kind = store_kind(url)
    _refuse_secrets(parsed)  # first: before any other error message repeats the URL, and the secret in it
    if operator:
        parsed.params = {**kind.recorded_params(parsed), **parsed.params}
    params = Params(url, parsed.scheme, parsed.params)
    # Read and checked here (``check_store_url`` reports a bad key at engine start); ``open_store`` reads it
    # again through ``store_keyring`` for the keyring it uses, and that read logs a shared key file.
    keyring = _integrity_param(params, warn_if_shared=False)
    checksum = _checksum_param(params, keyed=keyring is not None)
    opener = kind.opener(parsed, params)
    if operator:
        return opener, checksum

    def open_and_record() -> Backend:
        backend = opener()
        kind.record(backend)
        return backend

    return open_and_record, checksum


def _checksum_param(params: Params, *, keyed: bool) -> ChecksumAlgo:
    """The ``checksum`` parameter. With an integrity key (``keyed``) frames carry a keyed hash instead, which
    catches whatever a checksum would; ``none`` is refused then, since it asks for no verification."""
    name = params.text("checksum", "auto")
    try:
        checksum = checksum_from_name(name)
    except ValueError as error:
        raise params.fail("checksum", name, str(error)) from None
    if keyed and checksum is ChecksumAlgo.NONE:
        raise params.fail(
            "checksum",
            name,
            f"a store with an integrity key ({', '.join(INTEGRITY_PARAMS)}) verifies every value with its "
            "keyed hash; leave checksum out (the connector adds checksum=none when verify_checksums is false)",
        )
    return checksum


#: The parameters that name a store's integrity secret (``hybridkv.store.integrity``), at most one of them.
INTEGRITY_PARAMS = ("integrity_key_file", "integrity_key_env")
#: Parameters that would carry a secret in the URL itself: refused without repeating the URL.
_SECRET_PARAMS = ("integrity_key", "integrity_secret")


def _refuse_secrets(parsed: ParsedUrl) -> None:
    """Raise ``StoreError`` if ``parsed`` carries a secret in one of ``_SECRET_PARAMS``. Not ``Params.fail``:
    its message repeats the URL, and with it the secret, into every log that shows the error."""
    for name in _SECRET_PARAMS:
        if name in parsed.params:
            raise StoreError(
                f"store URL parameter {name} is refused: a store URL names where its integrity secret is "
                f"({' or '.join(f'{param}=...' for param in INTEGRITY_PARAMS)}), never the secret itself "
                "(the URL is not repeated here, since it holds one)"
            )


def _integrity_param(params: Params, *, warn_if_shared: bool) -> Keyring | None:
    """The keyring ``integrity_key_file=PATH`` or ``integrity_key_env=NAME`` names, read and checked now;
    ``None`` without either. Raises ``StoreError`` naming the parameter: both given, a missing, unreadable
    or non-regular file, an unset variable, no secret, one shorter than 16 bytes, a repeated one. With
    ``warn_if_shared``, a key file that others may read is logged."""
    key_file = params.optional_text("integrity_key_file")
    key_env = params.optional_text("integrity_key_env")
    if key_file is not None and key_env is not None:
        raise params.fail(
            "integrity_key_env",
            key_env,
            "give one of integrity_key_file and integrity_key_env, not both (one source of secrets, so that "
            "rotating it cannot miss the other)",
        )
    if key_file is not None:
        try:
            return keyring_from_file(key_file, warn_if_shared=warn_if_shared)
        except ValueError as error:
            raise params.fail("integrity_key_file", key_file, str(error)) from None
    if key_env is not None:
        try:
            return keyring_from_environment(key_env)
        except ValueError as error:
            raise params.fail("integrity_key_env", key_env, str(error)) from None
    return None


def store_keyring(url: str) -> Keyring | None:
    """The integrity keyring ``url`` names (through any ``faulty+`` view), or ``None`` without one; raises
    ``StoreError`` naming a bad integrity parameter (``open_store`` checks the rest of the URL)."""
    inner = url.removeprefix(FAULTY_PREFIX)
    if "://" not in inner:
        return None  # no store URL at all: ``open_backend`` says why
    parsed = split_url(inner)
    _refuse_secrets(parsed)
    return _integrity_param(Params(url, parsed.scheme, parsed.params), warn_if_shared=True)


def _faulty_opener(url: str, *, operator: bool) -> tuple[Callable[[], Backend], ChecksumAlgo]:
    inner_url_with_params = url[len(FAULTY_PREFIX) :]
    if "://" not in inner_url_with_params:
        raise StoreError(
            f"store URL {shown_url(url)!r}: {FAULTY_PREFIX} wraps another store URL "
            f"({FAULTY_PREFIX}memory://NAME, {FAULTY_PREFIX}file:///DIR, ...), "
            f"got {shown_url(inner_url_with_params)!r}"
        )
    parsed = split_url(inner_url_with_params)
    faulty_values = {name: parsed.params.pop(name) for name in FAULTY_PARAMS if name in parsed.params}
    base = inner_url_with_params.split("?", 1)[0]
    inner_url = f"{base}?{urlencode(parsed.params)}" if parsed.params else base
    params = Params(url, FAULTY_PREFIX, faulty_values)
    # Every parameter is read (and checked) before ``finish`` refuses unknown ones and the inner store opens.
    faulty = FaultyBackend.factory(params)
    params.finish()
    open_inner, checksum = _backend_opener(inner_url, operator=operator)
    return lambda: faulty(url, open_inner()), checksum


def _absent_file_store(parsed: ParsedUrl) -> str | None:
    directory = Path(parsed.path)  # the directory ``_open_file`` opens (its path is not percent-decoded)
    if not (directory / "objects").is_dir():
        return f"no file store at {str(directory)!r}"
    return None


def _record_file_capacity(backend: Backend) -> None:
    assert isinstance(backend, FileBackend), f"a file:// URL opened {type(backend).__name__}"
    record_capacity(backend.directory, backend.capacity_bytes)


def _recorded_file_params(parsed: ParsedUrl) -> dict[str, str]:
    capacity = recorded_capacity(Path(parsed.path))
    return {} if capacity is None else {"capacity": str(capacity)}


def absent_store(url: str) -> str | None:
    """Why ``url`` (through any ``faulty+`` view) names no existing store, or None (see ``StoreKind.absent``)."""
    inner = url.removeprefix(FAULTY_PREFIX)
    return store_kind(url).absent(split_url(inner))


def _open_memory(parsed: ParsedUrl, params: Params) -> Callable[[], Backend]:
    if not parsed.netloc:
        raise StoreError(f"store URL {shown_url(parsed.url)!r}: memory:// needs a name (memory://NAME)")
    if parsed.path not in ("", "/"):
        raise StoreError(
            f"store URL {shown_url(parsed.url)!r}: memory:// takes a name, not a path ({parsed.path!r})"
        )
    capacity = params.size("capacity", -1)
    quotas = _quotas_param(params, capacity_bytes=None if capacity < 0 else capacity)
    params.finish()
    return functools.partial(
        MemoryBackend,
        parsed.url,
        parsed.netloc,
        capacity_bytes=None if capacity < 0 else capacity,
        quotas=quotas,
    )


def _quotas_param(params: Params, *, capacity_bytes: int | None) -> dict[str, int]:
    """``quotas=NS:SIZE[,NS:SIZE...]`` (``hybridkv.store.quotas``), checked against the capacity."""
    text = params.optional_text("quotas")
    if text is None:
        return {}
    try:
        quotas = parse_quotas(text)
        check_quotas(quotas, capacity_bytes=capacity_bytes)
    except ValueError as error:
        raise params.fail("quotas", text, str(error)) from None
    return quotas


def _open_file(parsed: ParsedUrl, params: Params) -> Callable[[], Backend]:
    if parsed.netloc not in ("", "localhost"):
        raise StoreError(
            f"store URL {shown_url(parsed.url)!r}: file URLs need an absolute directory (file:///DIR), "
            f"got host {parsed.netloc!r}"
        )
    if not parsed.path or parsed.path == "/":
        raise StoreError(f"store URL {shown_url(parsed.url)!r}: missing directory (file:///DIR)")
    capacity = params.size("capacity", DEFAULT_FILE_CAPACITY)
    if capacity <= 0:
        raise StoreError(f"store URL {shown_url(parsed.url)!r}: parameter capacity must be > 0")
    # None: the backend picks (a deadline where the directory's file system may hang, none on a local one).
    timeout_ms = params.optional_integer("timeout_ms", minimum=-(1 << 63), maximum=MAX_DURATION_MS)
    if timeout_ms is not None and timeout_ms <= 0:
        raise params.fail(
            "timeout_ms",
            str(timeout_ms),
            "the deadline of each call must be > 0 ms (leave it out for the default: "
            f"{DEFAULT_HANG_TIMEOUT_MS} on a network or FUSE file system, none on a local one)",
        )
    params.finish()
    return functools.partial(
        FileBackend, parsed.url, Path(parsed.path), capacity_bytes=capacity, timeout_ms=timeout_ms
    )


def _mooncake_protocol(params: Params) -> str:
    """The ``protocol`` parameter of a mooncake:// URL: only ``tcp``; ``rdma`` is refused by name.

    RDMA needs every buffer a transfer reads or writes registered with Mooncake's transfer engine
    (``register_buffer``), and this backend hands Mooncake the caller's buffers unregistered (see
    ``hybridkv.store.mooncake``). An ``rdma`` URL would open and then fail its transfers, so it is refused
    here, when the engine opens its store."""
    protocol = params.choice("protocol", "tcp", ("tcp", "rdma"))
    if protocol == "rdma":
        raise params.fail(
            "protocol",
            protocol,
            "mooncake:// protocol=rdma is not supported: this backend registers no buffers with Mooncake's "
            "transfer engine, which RDMA transfers need; use protocol=tcp",
        )
    return protocol


def _mooncake_timeout_ms(params: Params) -> int:
    """The ``timeout_ms`` parameter of a mooncake:// URL (default 2000): the deadline of every call, > 0.

    ``0`` used to mean "no deadline": a call then ran on the caller's thread until Mooncake answered, and a
    hung master (its RPC timeout can be set to never fire) held the worker's load thread and the request
    waiting for it forever. Refused by name rather than mapped to some default, so that no deployment
    believes it runs without one."""
    timeout_ms = params.integer("timeout_ms", 2000, minimum=-(1 << 63), maximum=MAX_DURATION_MS)
    if timeout_ms <= 0:
        raise params.fail(
            "timeout_ms",
            str(timeout_ms),
            "every Mooncake call needs a deadline: a hung master would hold a request forever; "
            "use timeout_ms > 0",
        )
    return timeout_ms


def _open_mooncake(parsed: ParsedUrl, params: Params) -> Callable[[], Backend]:
    host, _, port_text = parsed.netloc.rpartition(":")
    if not host or not _MOONCAKE_PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
        raise StoreError(f"store URL {shown_url(parsed.url)!r}: mooncake:// needs the master as HOST:PORT")
    from hybridkv.store.mooncake import MooncakeBackend  # here: other schemes never load the Mooncake adapter

    # Every parameter is read (and checked) before ``finish`` refuses unknown ones and the client connects.
    mooncake = functools.partial(
        MooncakeBackend,
        parsed.url,
        parsed.netloc,
        metadata_server=params.text("metadata", "P2PHANDSHAKE"),
        local_hostname=params.text("local_hostname", "127.0.0.1"),
        segment_bytes=params.size("segment", 1 << 30),
        local_buffer_bytes=params.size("local_buffer", 64 << 20),
        protocol=_mooncake_protocol(params),
        device=params.text("device", ""),
        timeout_ms=_mooncake_timeout_ms(params),
        breaker_failures=params.integer("breaker_failures", 1, minimum=1),
        breaker_reset_s=params.number("breaker_reset_s", 5.0),
        preferred_segment=params.text("preferred_segment", "local"),
    )
    params.finish()
    return mooncake


# fmt: off
#: The built-in stores. A store of another package registers its row through an entry point instead
#: (``hybridkv.store.plugins``).
STORE_KINDS: Mapping[str, StoreKind] = {kind.scheme: kind for kind in (
    StoreKind("memory",   _open_memory,   StoreTier.HOST,     process_local=True,  params=("capacity",)),
    StoreKind("file",     _open_file,     StoreTier.DISK,     process_local=False, params=("capacity", "timeout_ms"),
              absent=_absent_file_store, record=_record_file_capacity, recorded_params=_recorded_file_params),
    StoreKind("mooncake", _open_mooncake, StoreTier.EXTERNAL, process_local=False,
              params=("metadata", "local_hostname", "segment", "local_buffer", "protocol", "device",
                      "timeout_ms", "breaker_failures", "breaker_reset_s", "preferred_segment"),
              lookup_client_params={"segment": "0"}),
)}
# fmt: on
