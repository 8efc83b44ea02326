"""Every bad ``kv_connector_extra_config`` tried: ``ConnectorConfig.from_extra_config`` accepts (and then each
field has its type and range) or raises ``ValueError`` naming the bad key and its value, never another error.

Keys: every known key, near-miss spellings, unknown and non-string keys; values: every JSON type (huge and
negative ints, NaN and infinities, empty / unicode / garbage text, lists, objects) next to plausible ones, so
both the accepting and the refusing paths run. The inputs that once crashed are kept as ``@example``s.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hybridkv.connector.config import (
    CUDA_COPY_DIRECTIONS,
    KNOWN_KEYS,
    LOAD_MODES,
    MAX_CPU_ID,
    MAX_PUT_WAVE_BYTES,
    ConnectorConfig,
)
from hybridkv.key_grammar import NAMESPACE_RE
from hybridkv.store.params import MAX_DURATION_MS
from hybridkv.store.url import check_store_url, store_kind
from hypothesis import example, given
from hypothesis import strategies as st

# One scratch folder for the module: a directory that exists (for ``audit_log``) and one that does not.
_SCRATCH = tempfile.TemporaryDirectory(prefix="hybridkv-config-fuzz-")
_EXISTING = Path(_SCRATCH.name)
_MISSING = _EXISTING / "missing"

_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e308, 5e-324, -0.0, 1e-300])
    | st.text(max_size=12)
    | st.sampled_from(
        ["", " ", "\n", "\x00", "\udcff", "\ud800", "١٢", "²", "ｆｕｌｌ", "64MiB", "1e999", "null"]
    )
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)

_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,70}", fullmatch=True)
_SIZE = st.builds(
    lambda number, space, unit: f"{number}{space}{unit}",
    st.integers(0, 10**22).map(str) | st.sampled_from(["1.5", "0.5", "1.25", "9" * 30]),
    st.sampled_from(["", " "]),
    st.sampled_from(
        ["", "B", "KiB", "MiB", "GiB", "TiB", "Ki", "Gi", "KB", "MB", "GB", "TB", "kib", "m", "G", "EiB"]
    ),
)
_STORE = st.sampled_from(
    [
        "memory://fuzz",
        "memory://fuzz?capacity=64MiB",
        "memory://",
        "memory://x/path",
        "memory://x#frag",
        "memory://x?capacity=1e999",
        "memory://[x",
        "MEMORY://x",
        "file:///tmp/hybridkv-fuzz?capacity=1GiB&timeout_ms=100",
        "file://host/dir",
        "file:///tmp/x?timeout_ms=99999999999999999999",
        "mooncake://127.0.0.1:50051?segment=0",
        "mooncake://[::1:80",
        "mooncake://h:²",
        "faulty+memory://x?delay_ms=inf",
        "faulty+memory://x?get_fail=0.5&seed=3",
        "faulty+",
        "redis://x",
    ]
) | st.builds(
    lambda name, query: f"memory://{name}{query}", _NAME, st.sampled_from(["", "?capacity=1KiB", "?x=1"])
)
_AUDIT_LOG = st.sampled_from(
    [
        str(_EXISTING / "audit.jsonl"),
        str(_MISSING / "audit.jsonl"),
        str(_EXISTING),
        "/",
        "",
        "~nosuchuser-hybridkv/audit.jsonl",
        str(_EXISTING / "a\x00b"),
        str(_EXISTING / ("a" * 300)),
        "/" + "a" * 5000 + "/audit.jsonl",
        str(_EXISTING / "\ud800"),
        str(_EXISTING / "\udcff.jsonl"),
    ]
)
#: plausible values per key, next to the JSON garbage every key also gets
_PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "store": _STORE,
    "namespace": _NAME | st.sampled_from(["abc\n", "a/b", "-x", "x" * 65]),
    "audit_log": _AUDIT_LOG,
    "put_wave_bytes": _SIZE
    | st.integers(-5, 2**64)
    | st.sampled_from([MAX_PUT_WAVE_BYTES, MAX_PUT_WAVE_BYTES + 1, 2**62, "16GiB", "17GiB", "1TiB"]),
    "lookup_budget_ms": st.floats(-1, 2 * MAX_DURATION_MS) | st.integers(-5, 2 * MAX_DURATION_MS),
    "verify_checksums": st.booleans(),
    "divergent_local_hits": st.booleans(),
    "lookup_process": st.booleans(),
    "step_trace": st.booleans(),
    "load_mode": st.sampled_from([*LOAD_MODES, "Async", "LAYERWISE", "sync"]),
    "cuda_copy": st.sampled_from([*CUDA_COPY_DIRECTIONS, "Auto", "cuda"]),
    "weights_version": _NAME | st.sampled_from(["v1\n", "v1/step", ""]),
    "weights_version_file": _AUDIT_LOG,  # a path whose directory exists, like the audit log's
    "worker_cpus": st.sampled_from(
        [
            "auto",
            "inherit",
            "Auto",
            "0",
            "14,15",
            "12-15",
            "0 2 4",
            "0-7:2",
            "3-1",
            "0-3:0",
            "",
            " ",
            "1,,2",
            "a",
            "-1",
            "8191",
            "8192",
            "0-99999",
            "0x1",
        ]
    )
    | st.lists(st.integers(0, 9), max_size=3),
}
assert set(_PLAUSIBLE) == set(KNOWN_KEYS), "a key ConnectorConfig knows has no plausible values here"
#: keys whose values are refused only beside another key's: the message blames the first, and the pair
#: alone (with the other as given, or absent) must be refused
_REFUSED_WITH: dict[str, tuple[str, ...]] = {"lookup_process": ("store",)}


def _near_misses(key: str) -> st.SearchStrategy[str]:
    """Spellings one slip away from ``key``: case, a dropped / doubled / swapped letter, '-' for '_', a space."""
    variants = {key.upper(), key.title(), key.replace("_", "-"), f" {key}", f"{key} ", key + "s", key[:-1]}
    variants |= {key[:i] + key[i + 1 :] for i in range(len(key))}
    variants |= {key[:i] + key[i + 1] + key[i] + key[i + 2 :] for i in range(len(key) - 1)}
    return st.sampled_from(sorted(variants - set(KNOWN_KEYS)))


_KNOWN_ENTRY = st.sampled_from(KNOWN_KEYS).flatmap(
    lambda key: st.tuples(st.just(key), _PLAUSIBLE[key] | _PLAUSIBLE[key] | _JSON)
)
_UNKNOWN_KEY = (
    st.sampled_from(KNOWN_KEYS).flatmap(_near_misses) | st.text(max_size=10) | st.integers() | st.none()
).filter(lambda key: key not in KNOWN_KEYS)
_EXTRA = st.lists(_KNOWN_ENTRY, max_size=5).map(dict) | st.builds(
    lambda known, unknown: {**dict(known), **dict(unknown)},
    st.lists(_KNOWN_ENTRY, max_size=3),
    st.lists(st.tuples(_UNKNOWN_KEY, _JSON), min_size=1, max_size=2),
)
_MODEL = st.text(max_size=40) | st.sampled_from(
    ["/models/Qwen3-Next-80B-A3B-Instruct/", "", "/", "._-", "ü/ß"]
)

_KEY_IN_MESSAGE = re.compile(r"^kv_connector_extra_config\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]: ")


def _check_accepted(cfg: ConnectorConfig, extra: dict[Any, Any]) -> None:
    """Every field of an accepted config has its type and range."""
    assert set(extra) <= set(KNOWN_KEYS), extra
    assert isinstance(cfg.store, str)
    check_store_url(cfg.store)
    if extra.get("store") is not None:
        assert cfg.store == extra["store"]
    assert isinstance(cfg.namespace, str) and NAMESPACE_RE.fullmatch(cfg.namespace), cfg.namespace
    if cfg.audit_log is not None:
        path = Path(cfg.audit_log)
        assert isinstance(cfg.audit_log, str) and "\0" not in cfg.audit_log
        os.fsencode(cfg.audit_log)
        assert path.parent.is_dir() and not path.is_dir(), cfg.audit_log
    assert type(cfg.put_wave_bytes) is int and 0 < cfg.put_wave_bytes <= MAX_PUT_WAVE_BYTES
    assert type(cfg.lookup_budget_ms) is float and math.isfinite(cfg.lookup_budget_ms)
    assert 0 < cfg.lookup_budget_ms <= MAX_DURATION_MS
    assert type(cfg.verify_checksums) is bool
    assert type(cfg.divergent_local_hits) is bool
    assert type(cfg.lookup_process) is bool
    assert type(cfg.step_trace) is bool
    assert cfg.worker_cpus in ("auto", "inherit") or (
        isinstance(cfg.worker_cpus, frozenset) and cfg.worker_cpus and max(cfg.worker_cpus) <= MAX_CPU_ID
    ), cfg.worker_cpus
    assert not (cfg.lookup_process and store_kind(cfg.store).process_local), cfg.store
    assert cfg.load_mode in LOAD_MODES and cfg.cuda_copy in CUDA_COPY_DIRECTIONS
    assert isinstance(cfg.weights_version, str)
    assert cfg.weights_version == "" or NAMESPACE_RE.fullmatch(cfg.weights_version)
    if cfg.weights_version_file is not None:
        path = Path(cfg.weights_version_file)
        assert "\0" not in cfg.weights_version_file
        os.fsencode(cfg.weights_version_file)
        assert path.parent.is_dir() and not path.is_dir(), cfg.weights_version_file


def _check_refused(message: str, extra: dict[Any, Any], model: str) -> None:
    """The message names the key at fault and its value; that key alone is refused too."""
    unknown = [key for key in extra if key not in KNOWN_KEYS]
    if message.startswith("kv_connector_extra_config: unknown key(s) "):
        assert unknown, message
        for key in unknown:
            assert repr(key) in message, (key, message)
        return
    assert not unknown, f"unknown key(s) {unknown} not reported first: {message}"
    match = _KEY_IN_MESSAGE.match(message)
    assert match is not None, f"the message names no key: {message}"
    key = next(k for k in KNOWN_KEYS if repr(k) == match.group(1))
    assert key in extra, (key, message)
    assert repr(extra[key])[:20] in message, (extra[key], message)
    alone = {key: extra[key]} | {
        other: extra[other] for other in _REFUSED_WITH.get(key, ()) if other in extra
    }
    try:
        ConnectorConfig.from_extra_config(alone, model=model)
    except ValueError:
        pass
    else:
        raise AssertionError(f"blamed {key}={extra[key]!r}, which alone is accepted: {message}")


@given(extra=_EXTRA, model=_MODEL)
@example(extra={"store": "memory://x", "lookup_process": True}, model="m")  # refused beside the store only
@example(extra={1: "a", "b": 2}, model="m")  # was TypeError: sorting int and str keys
@example(extra={"namespace": "abc\n"}, model="m")  # was accepted: `$` matches before a final newline
@example(extra={"weights_version": "v1\n"}, model="m")  # was accepted, as namespace
@example(extra={"lookup_budget_ms": 10**400}, model="m")  # was OverflowError (float(int))
@example(extra={"lookup_budget_ms": math.inf}, model="m")  # was accepted: lookups without a deadline
@example(extra={"lookup_budget_ms": 1e300}, model="m")  # was accepted: describe's deadline overflowed
@example(extra={"put_wave_bytes": 10**400}, model="m")  # was accepted: no int64 holds it
@example(extra={"put_wave_bytes": 2**62}, model="m")  # was accepted: the worker's pinned allocation failed
@example(extra={"audit_log": str(_EXISTING / "a\x00b")}, model="m")  # was accepted: the sink's open failed
@example(extra={"audit_log": "~nosuchuser-hybridkv/audit.jsonl"}, model="m")  # was RuntimeError
@example(extra={"audit_log": "/" + "a" * 5000 + "/audit.jsonl"}, model="m")  # was OSError (name too long)
@example(extra={"audit_log": str(_EXISTING / "\ud800")}, model="m")  # was accepted: not encodable
@example(extra={"audit_log": str(_EXISTING)}, model="m")  # was accepted: a directory, the sink's open failed
@example(extra={"store": "memory://"}, model="m")  # was accepted: the URL was checked only at open
@example(extra={"store": "mooncake://[::1:80"}, model="m")  # was accepted; open raised a bare ValueError
@example(extra={"store": "memory://x#frag"}, model="m")  # was accepted: the fragment silently dropped
@example(extra={"store": "faulty+memory://x?delay_ms=inf"}, model="m")  # was accepted: sleep(inf) overflowed
def test_extra_config_is_accepted_in_range_or_refused_naming_the_key(
    extra: dict[Any, Any], model: str
) -> None:
    try:
        cfg = ConnectorConfig.from_extra_config(extra, model=model)
    except ValueError as error:
        _check_refused(str(error), extra, model)
    else:
        _check_accepted(cfg, extra)


@given(
    extra=_JSON_SCALARS.filter(lambda value: value is not None)
    | st.lists(_JSON, max_size=3)
    | st.lists(st.tuples(st.text(), _JSON))
)
@example(extra="abc")  # was ValueError from dict(): "dictionary update sequence element #0 ..."
@example(extra=5)  # was TypeError: 'int' object is not iterable
@example(extra=[("store", "memory://x")])  # was accepted as a mapping
def test_extra_config_that_is_no_mapping_is_refused(extra: Any) -> None:
    try:  # (None is no extra config at all: the defaults)
        ConnectorConfig.from_extra_config(extra, model="m")
    except ValueError as error:
        assert str(error).startswith("kv_connector_extra_config: expected a JSON object"), error
        assert repr(extra)[:20] in str(error), error
    else:
        raise AssertionError(f"accepted {extra!r}")
