"""Every bad audit file tried: ``hybridkv audit FILE`` exits 2 naming the first malformed line (not UTF-8,
not a JSON object, fields of the wrong type), 0 or 1 for a well-formed log (clean or violating), and never
fails with a traceback.

Files are the records of a real run (the lifecycle machine writing through the JSON-lines sink) mixed with a
truncated last line, binary bytes, bytes that are not UTF-8, a 10 MB line, JSON of the wrong type (a list
for an object, numbers as strings, missing, extra and nested-garbage fields), nesting deeper than the JSON
parser goes and lone-surrogate escapes. Which lines are malformed is decided here from docs/lifecycle.md's
definition. The inputs that once crashed are kept as ``@example``s; a few run through the installed command.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hybridkv.audit.sinks import DROPPED_EVENT, JsonLinesAuditSink
from hybridkv.cli import main
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, LoadOutcome
from hybridkv.lifecycle.machine import LifecycleMachine
from hypothesis import event, example, given
from hypothesis import strategies as st

_SCHEME = KeyScheme(
    namespace="t", model="m", geometry=Geometry(groups=(GroupSpec.full(16), GroupSpec.mamba(32)))
)
# One scratch root for the module, removed at interpreter exit; each example writes into a fresh folder.
_SCRATCH = tempfile.TemporaryDirectory(prefix="hybridkv-audit-fuzz-")
_HUGE = 10 << 20
_HYBRIDKV = Path(sys.executable).parent / "hybridkv"


def _real_run() -> list[bytes]:
    """The lines a real run writes: lifecycles that hit, fail a load (truncation and retry), and save."""
    path = Path(tempfile.mkdtemp(dir=_SCRATCH.name)) / "audit.jsonl"
    with JsonLinesAuditSink(path) as sink:
        machine = LifecycleMachine(_SCHEME, sink=sink)
        hashes = [bytes([i]) * 8 for i in range(8)]
        for request_id, fail in (("ok", False), ("bad", True), ("ok-2", False)):
            lifecycle = machine.new_request(request_id)
            search = lifecycle.start_search(hashes, 129, 0)
            assert search is not None
            result = lifecycle.finish_search(search.run(lambda keys: [True] * len(keys)))
            assert result.plan is not None
            lifecycle.start_load()
            outcomes = {entry: LoadOutcome.OK for entry, _ in result.plan.entries}
            if fail:
                outcomes[next(iter(outcomes))] = LoadOutcome.CORRUPT
            lifecycle.finish_load(outcomes)
            lifecycle.evict()
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) > 10 and all(line.endswith(b"\n") for line in lines)
    return lines


_REAL = _real_run()
_RECORDS: list[dict[str, Any]] = [json.loads(line) for line in _REAL]

#: 10 MB lines: junk, and a well-formed record carrying 10 MB of padding
_HUGE_JUNK = b"x" * _HUGE + b"\n"
_HUGE_RECORD = (json.dumps({**_RECORDS[0], "padding": "p" * _HUGE}) + "\n").encode()

_TEXT = st.text(max_size=8) | st.sampled_from(
    ["", "\udcff", "\ud800", "NEW", "LOOKUP", "evict", "start_load"]
)
_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | _TEXT
_JSON = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
#: JSON that is no object: a list, number, string, true / false or null where a record belongs
_NOT_OBJECT = _SCALARS | st.lists(_JSON, max_size=3)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode() + b"\n"  # ensure_ascii: a lone surrogate becomes a \\udcff escape


@st.composite
def _mutated_record(draw: st.DrawFn) -> bytes:
    """A real record with fields missing, of the wrong type, extra, or full of garbage."""
    record = dict(draw(st.sampled_from(_RECORDS)))
    how = draw(st.sampled_from(["missing", "as_string", "wrong_type", "extra", "garbage_detail", "unknown"]))
    if how == "missing":
        record.pop(
            draw(st.sampled_from(["request_id", "src", "dst", "trigger", "wave", "groups", "event"])), None
        )
    elif how == "as_string":
        for name in ("wave", "boundary", "num_computed_tokens", "monotonic"):
            record[name] = str(record.get(name))
    elif how == "wrong_type":
        record[draw(st.sampled_from(["request_id", "src", "dst", "trigger", "wave"]))] = draw(_JSON)
    elif how == "extra":
        record.update(draw(st.dictionaries(st.text(max_size=8), _JSON, min_size=1, max_size=3)))
    elif how == "garbage_detail":
        for name in draw(st.lists(st.sampled_from(["groups", "detail", "boundary", "num_computed_tokens"]))):
            record[name] = draw(_JSON)
    else:  # strings that are no state / trigger / id the table knows, surrogates included
        record[draw(st.sampled_from(["request_id", "src", "dst", "trigger"]))] = draw(_TEXT)
    return _dumps(record)


@st.composite
def _not_utf8(draw: st.DrawFn) -> bytes:
    line = draw(st.sampled_from(_REAL))
    at = draw(st.integers(0, len(line) - 1))
    return (
        line[:at]
        + draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80", b"\xfe\xfe"]))
        + line[at:]
    )


_CHUNKS = st.one_of(
    st.sampled_from(_REAL),
    st.binary(max_size=48),
    _not_utf8(),
    _mutated_record(),
    _NOT_OBJECT.map(_dumps),
    st.sampled_from(
        [
            b"[" * 100_000 + b"\n",  # deeper than the JSON parser goes
            b'{"a":' * 100_000 + b"\n",
            b"   \n",
            b"\r\n",
            _dumps({"event": DROPPED_EVENT, "num_dropped": 3, "monotonic": 1.0}),
            _dumps({"event": DROPPED_EVENT, "num_dropped": "3"}),
            b'{"event": "x", "request_id": "r", "wave": NaN, "src": "NEW", "dst": "LOOKUP", "trigger": "x"}\n',
            b"\x00\x00\x00\n",
        ]
    ),
)


@st.composite
def audit_files(draw: st.DrawFn) -> bytes:
    """A file's bytes: the real run (whole or sampled) with chunks inserted, maybe a huge line, maybe cut."""
    lines = list(draw(st.just(_REAL) | st.lists(st.sampled_from(_REAL), max_size=12)))
    for _ in range(draw(st.integers(0, 4))):
        lines.insert(draw(st.integers(0, len(lines))), draw(_CHUNKS))
    huge = draw(st.sampled_from([None] * 14 + [_HUGE_JUNK, _HUGE_RECORD]))
    if huge is not None:
        lines.insert(draw(st.integers(0, len(lines))), huge)
    data = b"".join(lines)
    if data and draw(st.booleans()):  # the writer died mid-line: the last line cut short, no newline
        data = data[: draw(st.integers(max(0, len(data) - 200), len(data) - 1))]
    return data


def _malformed_lines(data: bytes) -> list[int]:
    """The lines docs/lifecycle.md calls malformed: not UTF-8, not a JSON object, or without string
    ``request_id`` / ``src`` / ``dst`` / ``trigger`` and an int-or-null ``wave`` (blank lines and the sink's
    drop markers are no records)."""
    found = []
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
    for number, line in enumerate(text, start=1):
        if not line.strip():
            continue
        if any(0xD800 <= ord(char) <= 0xDFFF for char in line):
            found.append(number)
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            found.append(number)
            continue
        if not isinstance(record, dict):
            found.append(number)
            continue
        if record.get("event") == DROPPED_EVENT and isinstance(record.get("num_dropped"), int):
            continue
        strings = all(isinstance(record.get(name), str) for name in ("request_id", "src", "dst", "trigger"))
        if not strings or not (record.get("wave") is None or isinstance(record.get("wave"), int)):
            found.append(number)
    return found


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr as strict UTF-8 streams (as a terminal's or a pipe's are)."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    out.flush()
    err.flush()
    return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()  # type: ignore[attr-defined]


def _check_audit(data: bytes, mode: str) -> None:
    path = Path(tempfile.mkdtemp(dir=_SCRATCH.name)) / "audit.jsonl"
    path.write_bytes(data)
    flags = {"text": [], "json": ["--json"], "export": ["--export", "vllm-trace"]}[mode]
    code, out, err = _run(["audit", *flags, str(path)])
    assert "Traceback" not in err, err
    if mode == "export":  # the trace skips what it cannot carry; it checks nothing
        assert code == 0, err
        for line in out.splitlines():
            assert json.loads(line)["schema"] == "vllm-kv-connector-v1"
        return
    malformed = _malformed_lines(data)
    event(f"exit {code}")
    if malformed:
        assert code == 2, (code, malformed, err)
        assert f"{path} line {malformed[0]} is malformed" in err, (malformed, err)
    else:
        assert code in (0, 1), (code, err)
        assert data != b"".join(_REAL) or code == 0, out
    if mode == "json":
        report = json.loads(out)
        assert report["ok"] is (code == 0), report["violation_counts"]
        assert [v["line"] for v in report["violations"] if v["kind"] == "malformed"] == malformed


@given(data=audit_files(), mode=st.sampled_from(["text", "text", "json", "export"]))
@example(data=b"".join(_REAL), mode="text")  # a clean run: 0
@example(data=b"".join(_REAL) + b'{"event": "x", "request', mode="text")  # cut mid-line: 2, its line named
@example(data=b"[" * 100_000 + b"\n", mode="text")  # was RecursionError
@example(data=b'{"a":' * 100_000 + b"\n", mode="export")  # was RecursionError
@example(data=_REAL[0].replace(b'"ok"', b'"ok\xff"'), mode="text")  # was read as U+FFFD and accepted
@example(data=_dumps({**_RECORDS[0], "request_id": "\udcff"}), mode="text")  # was UnicodeEncodeError on print
@example(data=_dumps({**_RECORDS[0], "src": "\ud800"}), mode="text")  # was UnicodeEncodeError on print
@example(data=_dumps({**_RECORDS[2], "monotonic": float("inf")}), mode="export")  # was OverflowError
@example(data=_dumps({**_RECORDS[2], "monotonic": float("nan")}), mode="export")  # was ValueError
@example(data=_dumps({**_RECORDS[2], "monotonic": 1e308}), mode="export")  # was OverflowError
@example(data=_dumps({**_RECORDS[2], "monotonic": 10**400}), mode="export")  # was OverflowError
@example(data=_dumps({**_RECORDS[2], "request_id": "\udcff"}), mode="export")  # was UnicodeEncodeError
@example(data=_dumps([1, 2]) + _dumps({**_RECORDS[0], "wave": "1"}), mode="json")  # wrong types: 2
@example(data=_HUGE_JUNK + b"".join(_REAL), mode="text")  # a 10 MB line: 2, line 1
@example(data=b"".join(_REAL) + _HUGE_RECORD, mode="json")  # a well-formed 10 MB record
def test_audit_file_exits_2_naming_the_malformed_line_never_a_traceback(data: bytes, mode: str) -> None:
    _check_audit(data, mode)


def _rotated(tmp_path: Path, sibling: bytes) -> Path:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(b"".join(_REAL))
    (tmp_path / "audit.jsonl.1.gz").write_bytes(sibling)
    return log


@pytest.mark.parametrize(
    ("sibling", "said"),
    [
        (gzip.compress(b"".join(_REAL) * 20)[:-30], "not a whole gzip file after line"),  # was EOFError
        (b"not gzip at all", "not a whole gzip file after line 0"),  # was "cannot read [...]: None"
    ],
    ids=["cut-short", "not-gzip"],
)
def test_a_broken_compressed_sibling_is_named(tmp_path: Path, sibling: bytes, said: str) -> None:
    log = _rotated(tmp_path, sibling)
    code, _out, err = _run(["audit", str(log)])
    assert code == 2 and f"cannot read {tmp_path / 'audit.jsonl.1.gz'}: {said}" in err, err


def test_a_malformed_line_of_a_rotated_set_is_named_by_file_and_line(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(_REAL[0] + b"{oops\n")
    (tmp_path / "audit.jsonl.1").write_bytes(b"".join(_REAL[:3]))
    code, _out, err = _run(["audit", str(log)])
    assert code == 2 and f"line 5 ({log} line 2) is malformed" in err, err


@pytest.mark.parametrize(
    ("data", "exit_code"),
    [
        (_HUGE_JUNK + b"".join(_REAL), 2),
        (b"".join(_REAL) + b'{"event": "load_fin', 2),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", 2),
        (b"[" * 100_000 + b"\n", 2),
        (_dumps({**_RECORDS[0], "request_id": "\udcff"}), 1),
        (b"".join(_REAL), 0),
    ],
    ids=["10MB-line", "cut-short", "binary", "deep", "surrogate-id", "clean"],
)
def test_the_installed_command_never_prints_a_traceback(tmp_path: Path, data: bytes, exit_code: int) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(data)
    done = subprocess.run(
        [str(_HYBRIDKV), "audit", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == exit_code, (done.returncode, done.stderr[-2000:])
    if exit_code == 2:
        assert f"{path} line " in done.stderr and "is malformed" in done.stderr, done.stderr
