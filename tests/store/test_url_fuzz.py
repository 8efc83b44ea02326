"""Every bad store URL tried: ``check_store_url`` (what the connector's configuration calls at engine start)
raises ``StoreError`` naming the bad part, never another error; the configuration turns it into a
``ValueError`` naming the ``store`` key; a valid URL stays valid, and a valid memory / file URL opens.

URLs are built from parts -- scheme (case variants, unknown), location, every parameter each kind declares
(``StoreKind.params``, ``checksum``, the integrity key's, the ``faulty+`` view's, its positional ones included) with valid or
garbage values, unknown and near-miss names, duplicates, empty names, fragments, percent-encoding -- with at
most one part broken, so that the error can be checked to name it. No Mooncake connection is opened: mooncake URLs are only checked.
The inputs that once crashed or were silently misread are kept as ``@example``s.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import quote

import pytest
from hybridkv.connector.config import ConnectorConfig
from hybridkv.store import StoreError, open_store
from hybridkv.store.faulty import FAULTY_PARAMS, MAX_PATTERN_NUMBER, PATTERN_OPS
from hybridkv.store.params import MAX_BYTE_SIZE, MAX_DURATION_MS, byte_size, parse_size
from hybridkv.store.url import FAULTY_PREFIX, INTEGRITY_PARAMS, STORE_KINDS, absent_store, check_store_url
from hypothesis import event, example, given
from hypothesis import strategies as st

# One scratch root for the module, removed at interpreter exit: file stores open under fresh folders of it.
_SCRATCH = tempfile.TemporaryDirectory(prefix="hybridkv-url-fuzz-")
# An integrity key, from a file and from the environment (set for this module's tests by ``_key_env``).
_KEY_FILE = Path(_SCRATCH.name) / "integrity.key"
_KEY_FILE.write_text("url-fuzz-integrity-secret-0123456789\n")
_KEY_FILE.chmod(0o600)
_KEY_ENV = "HYBRIDKV_URL_FUZZ_INTEGRITY_KEY"


@pytest.fixture(scope="module", autouse=True)
def _key_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_KEY_ENV, "url-fuzz-integrity-secret-from-the-environment")
        yield


_SIZES = st.builds(
    lambda number, unit: f"{number}{unit}",
    st.integers(0, 1 << 40),
    st.sampled_from(["", "B", "KiB", "MiB", "GiB", "Ki", "Mi", "KB", "MB", "GB", "kib", " KiB"]),
)
_POSITIVE_SIZES = st.builds(
    lambda number, unit: f"{number}{unit}", st.integers(1, 1 << 30), st.sampled_from(["", "B", "KiB", "MiB"])
)
_PROBABILITY = st.floats(0, 1).map(repr) | st.sampled_from(["0", "1", "0.5", "1e-3"])
_DURATION = st.integers(1, MAX_DURATION_MS).map(str)
_MS = st.floats(0, MAX_DURATION_MS).map(repr) | st.integers(0, MAX_DURATION_MS).map(str)
_HOSTNAME = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True)
#: positions, groups, ranks: distinct whole numbers, comma-separated, in any order
_NUMBER_LIST = st.lists(st.integers(0, MAX_PATTERN_NUMBER), min_size=1, max_size=4, unique=True).map(
    lambda numbers: ",".join(map(str, numbers))
)

#: valid values of every parameter, by name (a kind's own meaning where two kinds share a name)
_VALID: dict[tuple[str, str], st.SearchStrategy[str]] = {
    ("memory", "capacity"): _SIZES,
    ("file", "capacity"): _POSITIVE_SIZES,
    ("file", "timeout_ms"): _DURATION,
    ("mooncake", "metadata"): st.just("P2PHANDSHAKE") | _HOSTNAME.map(lambda host: f"http://{host}:8080"),
    ("mooncake", "local_hostname"): st.just("127.0.0.1") | _HOSTNAME,
    ("mooncake", "segment"): _SIZES,
    ("mooncake", "local_buffer"): _SIZES,
    ("mooncake", "protocol"): st.just("tcp"),
    ("mooncake", "device"): st.sampled_from(["", "eth0", "mlx5_0"]),
    ("mooncake", "timeout_ms"): _DURATION,
    ("mooncake", "breaker_failures"): st.integers(1, 1000).map(str),
    ("mooncake", "breaker_reset_s"): st.floats(0, 1e6).map(repr),
    ("mooncake", "preferred_segment"): st.sampled_from(["local", "none", "10.0.0.2:12345"]),
    ("*", "checksum"): st.sampled_from(["xxh3", "crc32", "none", "auto", "CRC32", "None"]),
    ("*", "integrity_key_file"): st.just(str(_KEY_FILE)),
    ("*", "integrity_key_env"): st.just(_KEY_ENV),
    ("faulty", "get_fail"): _PROBABILITY,
    ("faulty", "put_fail"): _PROBABILITY,
    ("faulty", "exists_fail"): _PROBABILITY,
    ("faulty", "corrupt"): _PROBABILITY,
    ("faulty", "get_late"): _PROBABILITY,
    ("faulty", "put_late"): _PROBABILITY,
    ("faulty", "delay_ms"): _MS,
    ("faulty", "late_ms"): _MS,
    ("faulty", "late_scribble"): st.sampled_from(["0", "1", "7"]),
    ("faulty", "seed"): st.integers(-(1 << 63), 1 << 70).map(str),
    **{("faulty", f"{op}_gap"): _NUMBER_LIST for op in PATTERN_OPS},
    **{("faulty", f"{op}_tail"): _PROBABILITY for op in PATTERN_OPS},
    **{("faulty", f"{op}_random_gaps"): st.integers(0, 64).map(str) for op in PATTERN_OPS},
    ("faulty", "fail_after"): st.integers(0, 1 << 40).map(str),
    ("faulty", "fail_calls"): st.integers(0, 1 << 40).map(str),
    ("faulty", "fail_ops"): st.lists(st.sampled_from(PATTERN_OPS), min_size=1, unique=True).map(",".join),
    ("faulty", "fault_group"): _NUMBER_LIST,
    ("faulty", "fault_tp_rank"): _NUMBER_LIST,
    ("faulty", "fault_dcp_rank"): _NUMBER_LIST,
}
for _kind in STORE_KINDS.values():
    for _param in _kind.params:
        assert (_kind.scheme, _param) in _VALID, (
            f"{_kind.scheme}:// parameter {_param} has no valid values here"
        )
assert all(("faulty", name) in _VALID for name in FAULTY_PARAMS)

_GARBAGE = st.text(max_size=12) | st.sampled_from(
    [
        "",
        " ",
        "-1",
        "-0",
        "0",
        "1e999",
        "-1e999",
        "inf",
        "Infinity",
        "nan",
        "1" + "0" * 40,
        "9" * 5000,
        "18446744073709551616",
        "2147483648",
        "١٠",
        "²",
        "٣MiB",
        "64m",
        "1.5",
        "0.5B",
        "0x10",
        "1_000",
        "10 EiB",
        "8EiB",
        "\x00",
        "\n",
        "a&b=c",
        "%ff",
        "rdma",
        "TCP",
        "0,,5",
        "1,",
        ",",
        "1,1",
        "1, 2",
        "get,get",
        "exists,remove",
        "9223372036854775808",
    ]
)


@dataclass(frozen=True)
class Case:
    """A URL from parts; ``expect``: substrings one of which a refusal must contain (empty: must be valid)."""

    scheme: str  # the inner store's scheme as written
    faulty: bool
    location: str  # what follows ``scheme://``, up to the query
    params: tuple[tuple[str, str], ...]  # (name, value) as written, already percent-encoded
    suffix: str = ""  # anything after the query (a fragment)
    expect: tuple[str, ...] = field(default=())

    @property
    def url(self) -> str:
        query = "&".join(f"{name}={value}" for name, value in self.params)
        prefix = FAULTY_PREFIX if self.faulty else ""
        return f"{prefix}{self.scheme}://{self.location}{'?' + query if query else ''}{self.suffix}"


def _encoded(text: str, percent: bool) -> str:
    """``text`` percent-encoded (all of it, or only what would break the URL's structure)."""
    return quote(text, safe="") if percent else quote(text, safe=" :/,;@!$'()*+~^|`{}[]<>\"\\")


@st.composite
def _locations(draw: st.DrawFn, scheme: str) -> str:
    if scheme == "memory":
        return draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,15}", fullmatch=True))
    if scheme == "file":
        segments = draw(
            st.lists(st.from_regex(r"[A-Za-z0-9._-]{1,8}|%20|%23|%25", fullmatch=True), min_size=1)
        )
        return draw(st.sampled_from(["", "localhost"])) + "/" + "/".join(segments)
    host = draw(st.sampled_from(["127.0.0.1", "localhost", "[::1]", "master.example"]))
    return f"{host}:{draw(st.integers(1, 65535))}"


_BAD_LOCATIONS: dict[str, list[tuple[str, str]]] = {
    "memory": [("", "needs a name"), ("x/dir", "not a path"), ("[x", "cannot be parsed")],
    "file": [("", "missing directory"), ("host/dir", "got host"), ("[::1/dir", "cannot be parsed")],
    "mooncake": [
        ("127.0.0.1", "HOST:PORT"),
        (":5000", "HOST:PORT"),
        ("h:0", "HOST:PORT"),
        ("h:65536", "HOST:PORT"),
        ("h:²", "HOST:PORT"),
        ("h:٨٠", "HOST:PORT"),
        ("h:-1", "HOST:PORT"),
        ("[::1:80", "cannot be parsed"),
    ],
}


_FAULTS = (
    "none",
    "value",
    "value",
    "value",
    "unknown",
    "duplicate",
    "empty_name",
    "fragment",
    "scheme",
    "location",
    "raw_char",
)
_Names = list[tuple[str, str]]


@st.composite
def store_cases(draw: st.DrawFn) -> Case:
    """A URL of valid parts, or with one part broken (``Case.expect`` says what a refusal must name)."""
    scheme = draw(st.sampled_from(sorted(STORE_KINDS)))
    faulty = draw(st.booleans())
    names = [("*", "checksum"), *(("*", name) for name in INTEGRITY_PARAMS)]
    names += [(scheme, name) for name in STORE_KINDS[scheme].params]
    names += [("faulty", name) for name in FAULTY_PARAMS] if faulty else []
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=5))
    if all(("*", name) in chosen for name in INTEGRITY_PARAMS):  # valid URLs name one source of secrets
        chosen.remove(("*", INTEGRITY_PARAMS[1]))
    keyed = any(("*", name) in chosen for name in INTEGRITY_PARAMS)
    percent = draw(st.booleans())
    params = [
        (_encoded(name, percent), _encoded(draw(_valid_value(owner, name, keyed=keyed)), percent))
        for owner, name in chosen
    ]
    case = Case(scheme=scheme, faulty=faulty, location=draw(_locations(scheme)), params=tuple(params))
    fault = draw(st.sampled_from(_FAULTS))
    if fault == "none":
        return case
    if fault in ("value", "unknown", "duplicate", "empty_name"):
        return _broken_query(draw, case, fault, names, percent)
    return _broken_url(draw, case, fault)


def _valid_value(owner: str, name: str, *, keyed: bool) -> st.SearchStrategy[str]:
    """Valid values of parameter ``name``; with an integrity key, ``checksum=none`` is not one."""
    if keyed and name == "checksum":
        return _VALID[owner, name].filter(lambda value: value.lower() != "none")
    return _VALID[owner, name]


def _broken_query(draw: st.DrawFn, case: Case, fault: str, names: _Names, percent: bool) -> Case:
    params = list(case.params)
    if fault == "value":
        owner, name = draw(st.sampled_from(names))
        value = draw(_GARBAGE)
        at = draw(st.integers(0, len(params)))
        params = [p for p in params if p[0] != _encoded(name, percent)]
        params.insert(min(at, len(params)), (_encoded(name, percent), _encoded(value, True)))
        # A garbage value may happen to be valid ("0", "1.5" for a delay): then the URL is accepted.
        return replace(case, params=tuple(params), expect=(f"parameter {name}", "?"))
    if fault == "unknown":
        known = {name for _, name in names}
        near = [name.upper() for _, name in names] + [name[:-1] for _, name in names] + ["capacty", "timeout"]
        unknown = draw(st.sampled_from(near) | st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
        if unknown in known or unknown in {"checksum", *FAULTY_PARAMS}:
            unknown += "x"
        params.insert(draw(st.integers(0, len(params))), (_encoded(unknown, percent), "1"))
        return replace(case, params=tuple(params), expect=(f"unknown parameter(s) {unknown}", unknown))
    if fault == "duplicate":
        owner, name = draw(st.sampled_from(names))
        value = _encoded(draw(_VALID[owner, name]), percent)
        params += [(_encoded(name, percent), value), (_encoded(name, not percent), value)]
        return replace(case, params=tuple(params), expect=(f"repeats parameter {name!r}",))
    params.insert(draw(st.integers(0, len(params))), ("", "1"))
    return replace(case, params=tuple(params), expect=("without a name",))


def _broken_url(draw: st.DrawFn, case: Case, fault: str) -> Case:
    if fault == "fragment":
        fragment = "#" + draw(st.text(max_size=5).map(lambda text: quote(text, safe="")))
        return replace(case, suffix=fragment, expect=("has a fragment",))
    if fault == "scheme":
        scheme = case.scheme
        written = draw(
            st.sampled_from(
                [scheme.upper(), scheme.title(), scheme + "s", scheme[:-1], "redis", "s3", "", " memory"]
            )
        )
        return replace(case, scheme=written, expect=("unknown scheme", "no scheme"))
    if fault == "location":
        location, culprit = draw(st.sampled_from(_BAD_LOCATIONS[case.scheme]))
        return replace(case, location=location, expect=(culprit,))
    # A raw character no URL may hold: a control character urlsplit would drop, or a lone surrogate.
    char = draw(st.sampled_from(["\n", "\t", "\r", "\x00", "\x7f", "\ud800", "\udcff"]))
    expect = ("control character", "lone surrogate")
    if draw(st.booleans()) or not case.params:
        return replace(case, location=case.location + char, expect=expect)
    params = list(case.params)
    params[0] = (params[0][0], params[0][1] + char)
    return replace(case, params=tuple(params), expect=expect)


def _opened(case: Case) -> None:
    """A valid memory / file URL opens (a fresh name / folder of its own), and names an existing store then."""
    if case.scheme == "memory":
        location = f"{case.location}-{uuid.uuid4().hex[:8]}"
    elif case.scheme == "file":
        host, _, path = case.location.partition("/")
        location = f"{host}{tempfile.mkdtemp(dir=_SCRATCH.name)}/{path}"
    else:
        return  # no Mooncake connection here
    url = replace(case, location=location).url
    with open_store(url):
        pass
    assert absent_store(url) is None, url


@given(case=store_cases())
@example(
    case=Case(
        "memory",
        False,
        "x",
        (("integrity_key_file", str(_KEY_FILE)), ("integrity_key_env", _KEY_ENV)),
        expect=("parameter integrity_key_env",),
    )
)  # two sources of secrets
@example(
    case=Case(
        "file",
        True,
        "/d",
        (("integrity_key_env", _KEY_ENV), ("checksum", "none")),
        expect=("parameter checksum",),
    )
)  # a keyed store verifies every value
@example(
    case=Case("memory", False, "x", (("integrity_key", "a-secret-in-the-url"),), expect=("integrity_key is",))
)  # refused without repeating the secret
@example(
    case=Case("mooncake", False, "[::1:80", (), expect=("cannot be parsed",))
)  # was ValueError (urlsplit)
@example(case=Case("memory", False, "[x", (), expect=("cannot be parsed",)))  # was ValueError (urlsplit)
@example(case=Case("mooncake", False, "h:²", (), expect=("HOST:PORT",)))  # was ValueError from int()
@example(case=Case("mooncake", False, "h:٨٠", (), expect=("HOST:PORT",)))  # was accepted: Mooncake dialled it
@example(case=Case("memory", False, "x", (), suffix="#frag", expect=("has a fragment",)))  # was dropped
@example(case=Case("file", False, "/data/a", (), suffix="#b", expect=("has a fragment",)))  # opened /data/a
@example(case=Case("file", False, "/tmp/a\nb", (), expect=("control character",)))  # opened /tmp/ab
@example(case=Case("file", False, "/tmp/\ud800", (), expect=("lone surrogate",)))  # failed at mkdir
@example(case=Case("", True, "", (), expect=("unknown scheme",)))  # faulty+:// wrapping nothing
@example(case=Case("memory", True, "x", (("delay_ms", "inf"),), expect=("parameter delay_ms",)))  # sleep(inf)
@example(case=Case("memory", True, "x", (("late_ms", "1e999"),), expect=("parameter late_ms",)))  # sleep(inf)
@example(case=Case("file", False, "/d", (("timeout_ms", "1" + "0" * 40),), expect=("parameter timeout_ms",)))
@example(
    case=Case("mooncake", False, "h:1", (("timeout_ms", "99999999999"),), expect=("parameter timeout_ms",))
)
@example(case=Case("file", False, "/d", (("timeout_ms", "١٢"),), expect=("parameter timeout_ms",)))  # read 12
@example(
    case=Case("mooncake", False, "h:1", (("breaker_reset_s", "inf"),), expect=("parameter breaker_reset_s",))
)
@example(case=Case("mooncake", False, "h:1", (("segment", "1" + "0" * 30),), expect=("parameter segment",)))
@example(case=Case("mooncake", False, "h:1", (("metadata", "%00"),), expect=("parameter metadata",)))
@example(case=Case("file", False, "/a%20b", ()))  # absent_store read /a b, the store opened /a%20b
@example(case=Case("memory", True, "x", (("get_gap", "0,0"),), expect=("parameter get_gap",)))
@example(case=Case("memory", True, "x", (("fault_group", ""),), expect=("parameter fault_group",)))
@example(case=Case("memory", True, "x", (("exists_tail", "1.5"),), expect=("parameter exists_tail",)))
@example(case=Case("memory", True, "x", (("fail_ops", "get,remove"),), expect=("parameter fail_ops",)))
@example(case=Case("memory", True, "x", (("fail_after", "3"), ("fail_calls", "2"), ("fail_ops", "get,put"))))
def test_store_url_is_valid_or_refused_naming_the_bad_part(case: Case) -> None:
    url = case.url
    try:
        check_store_url(url)
    except StoreError as error:
        message = str(error)
        assert case.expect, f"a valid URL refused: {url!r}: {message}"
        assert any(part in message for part in case.expect), f"{url!r}: {message} names none of {case.expect}"
        refused = True
        event("refused")
    else:
        # Only a garbage value may turn out valid; every other broken part must be refused.
        assert not case.expect or "?" in case.expect, f"accepted {url!r}, expected one of {case.expect}"
        refused = False
        event("accepted")
    # The engine-start path: the configuration checks the URL and names the ``store`` key.
    try:
        cfg = ConnectorConfig.from_extra_config({"store": url}, model="m")
    except ValueError as error:
        assert refused or not url.startswith(tuple(f"{s}://" for s in STORE_KINDS) + (FAULTY_PREFIX,)), error
        assert str(error).startswith("kv_connector_extra_config['store']: "), error
    else:
        assert not refused and cfg.store == url
    if not refused:
        _opened(case)


@given(text=st.text(max_size=20) | _GARBAGE | _SIZES)
@example(text="1" + "0" * 40)  # was accepted: no int64 holds it
@example(text="9" * 5000)  # Python's int-from-text limit: still a ValueError naming the size
@example(text="8EiB")  # "unknown unit": sizes stop at TiB
@example(text="٣MiB")  # other scripts' digits are not sizes
def test_sizes_parse_in_range_or_are_refused(text: str) -> None:
    try:
        num_bytes = byte_size(text)
    except ValueError:
        with pytest.raises(StoreError, match="bad size"):
            parse_size(text)
    else:
        assert type(num_bytes) is int and 0 <= num_bytes <= MAX_BYTE_SIZE
        assert parse_size(text) == num_bytes
