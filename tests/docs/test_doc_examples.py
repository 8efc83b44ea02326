"""Every example in README.md and docs/*.md is executed or validated here, so the docs cannot rot.

What is checked, per kind of example:

- ``--kv-transfer-config`` JSON (in shell commands and JSON blocks): parsed; ``kv_connector_extra_config`` validated by
  ``ConnectorConfig.from_extra_config`` and its store opened for real (paths moved into a temp dir); with vLLM
  installed, the whole object by vLLM's ``KVTransferConfig`` and each ``vllm serve`` line by vLLM's own parser.
- Store URLs anywhere in the text (code blocks, inline code, tables): placeholders (``HOST:PORT``, ``DIR``, ``SIZE``,
  ``P``...) replaced by sample values, then opened with ``hybridkv.store.open_store``: ``memory://`` and ``file://`` for
  real (with a round trip), ``mooncake://`` against a stand-in backend so every parameter is still parsed.
- ``hybridkv ...`` command lines: accepted by ``hybridkv.cli.build_parser()``; inline mentions must name existing
  subcommands. ``make`` targets and repository paths used in commands exist.
- Python blocks: executed; a following block marked ``<!-- doc-test: output -->`` must equal what they print.
- Audit logs marked ``<!-- doc-test: audit-log NAME -->``: replayed with the real ``hybridkv audit`` command, whose
  output and exit code must equal the block marked ``<!-- doc-test: audit-output NAME exit=N -->``. Single audit
  records in JSON blocks must be legal rows of the transition table.
- docs/lifecycle.md's state and transition tables and any generated Mermaid block equal the code's table.
- The README's ``kv_connector_extra_config`` table lists exactly the known keys, with the code's defaults.
- docs/metrics.md lists exactly the stats keys and Prometheus series the connector exports.
- Relative links (and their ``#anchors``) resolve; README links every page under docs/.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import io
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hybridkv.cli import build_parser
from hybridkv.cli import main as cli_main
from hybridkv.connector.config import KNOWN_KEYS, ConnectorConfig, default_store_url, parse_size
from hybridkv.connector.stores import open_connector_store
from hybridkv.lifecycle.audit import RECORD_KEYS
from hybridkv.lifecycle.diagram import render_mermaid
from hybridkv.lifecycle.machine import TRANSITIONS, State, transition_index
from hybridkv.store import Status, open_store

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOC_FILES = (README, *sorted(DOCS.glob("*.md")))

# -- extraction -------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the ``doc-test:`` marker on the last non-blank line before the fence

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@functools.cache
def blocks_of(path: Path) -> tuple[Block, ...]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence, lang = match.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i].removeprefix(indent))
            i += 1
        assert i < len(lines), f"{path.name}:{start + 1}: unclosed code fence"
        marker = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and (m := _MARKER.match(lines[j])):
            marker = m.group(1)
        blocks.append(Block(path, start + 1, lang.lower(), "\n".join(body) + "\n", marker))
        i += 1
    return tuple(blocks)


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in blocks_of(path)]


def prose_of(path: Path) -> str:
    """The file's text outside fenced code blocks."""
    out: list[str] = []
    inside: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _FENCE.match(line)
        if inside is None and match:
            inside = match.group(2)[0] * len(match.group(2))
            continue
        if inside is not None:
            if line.strip().startswith(inside):
                inside = None
            continue
        out.append(line)
    return "\n".join(out)


def inline_code(path: Path) -> list[str]:
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose_of(path))


_SHELL_LANGS = ("bash", "sh", "shell", "console", "")


def shell_commands(block: Block) -> list[list[str]]:
    """The commands of a shell block as argv lists (quotes, comments and continuation lines handled)."""
    if block.lang not in _SHELL_LANGS:
        return []
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return split_commands("\n".join(lines), block.where)


def split_commands(script: str, where: str) -> list[list[str]]:
    commands: list[list[str]] = []
    pending = ""
    for line in script.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:
            continue  # an open quote: the command goes on
        pending = ""
        if argv:
            commands.append(argv)
    assert not pending.strip(), f"{where}: unterminated shell command: {pending!r}"
    return commands


def strip_env_and_background(argv: list[str]) -> list[str]:
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv = argv[1:]
    return [arg for arg in argv if arg != "&"]


def all_commands() -> list[tuple[str, list[str]]]:
    """Every shell command in the docs, with ``sh -c SCRIPT`` scripts expanded."""
    found: list[tuple[str, list[str]]] = []

    def add(where: str, argv: list[str]) -> None:
        argv = strip_env_and_background(argv)
        if not argv:
            return
        found.append((where, argv))
        for i, arg in enumerate(argv[:-1]):
            if arg == "-c" and i >= 1 and Path(argv[i - 1]).name in ("sh", "bash"):
                for inner in split_commands(argv[i + 1], where):
                    add(where, inner)

    for block in all_blocks():
        for argv in shell_commands(block):
            add(block.where, argv)
    return found


def is_program(argv: list[str], name: str) -> bool:
    return bool(argv) and Path(argv[0]).name == name


# -- kv-transfer-config examples ---------------------------------------------------------------------------------


def kv_transfer_configs() -> list[tuple[str, str]]:
    """(where, JSON text) of every literal --kv-transfer-config and every JSON block holding one."""
    found: list[tuple[str, str]] = []
    for where, argv in all_commands():
        for i, arg in enumerate(argv):
            value = None
            if arg == "--kv-transfer-config" and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith("--kv-transfer-config="):
                value = arg.split("=", 1)[1]
            if value is not None and not value.startswith("$"):  # "$KV_CONFIG": set elsewhere
                found.append((where, value))
    for block in all_blocks():
        if block.lang == "json" and block.marker is None:
            with contextlib.suppress(ValueError):
                obj = json.loads(block.text)
                if isinstance(obj, dict) and "kv_connector" in obj:
                    found.append((block.where, block.text))
    return found


KV_CONFIGS = kv_transfer_configs()


def localize_extra_config(extra: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Move the example's paths into ``tmp_path`` (same file names), keep everything else."""
    extra = dict(extra)
    if isinstance(extra.get("store"), str):
        extra["store"] = concrete_url(extra["store"], tmp_path / "store")
    if isinstance(extra.get("audit_log"), str):
        extra["audit_log"] = str(tmp_path / "log" / Path(extra["audit_log"]).name)
        (tmp_path / "log").mkdir(exist_ok=True)
    return extra


def test_kv_transfer_config_examples_are_found() -> None:
    assert len(KV_CONFIGS) >= 1, "no --kv-transfer-config example found: the extractor is broken"


@pytest.mark.parametrize(("where", "text"), KV_CONFIGS, ids=[w for w, _ in KV_CONFIGS])
def test_kv_transfer_config_example(
    where: str, text: str, tmp_path: Path, fake_mooncake: list[dict[str, Any]]
) -> None:
    config = json.loads(text)
    assert config["kv_connector"] == "HybridStoreConnector", where
    if "kv_connector_module_path" in config:
        assert config["kv_connector_module_path"] == "hybridkv.connector", where
        assert importlib.util.find_spec(config["kv_connector_module_path"]) is not None, where
    assert config.get("kv_role") in ("kv_both", "kv_producer", "kv_consumer"), where
    assert config.get("kv_load_failure_policy") == "recompute", (
        f"{where}: examples must use the recompute policy"
    )
    extra = localize_extra_config(config.get("kv_connector_extra_config", {}), tmp_path)
    cfg = ConnectorConfig.from_extra_config(extra, model="/models/Qwen3-Next-80B-A3B-Instruct")
    store = open_connector_store(cfg)
    try:
        if not cfg.store.startswith(("mooncake://", "faulty+")):
            round_trip(store)
    finally:
        store.close()


@pytest.mark.vllm
def test_kv_transfer_configs_and_serve_lines_with_vllm() -> None:
    """vLLM itself accepts every example: KVTransferConfig for each JSON, its CLI parser for each `vllm serve`."""
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig

    for where, text in KV_CONFIGS:
        try:
            KVTransferConfig(**json.loads(text))
        except Exception as error:  # noqa: BLE001 -- pydantic's ValidationError and friends
            pytest.fail(f"{where}: vLLM's KVTransferConfig rejects the example: {error}")
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # pragma: no cover - another vLLM layout: the JSON check above still ran
        return
    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    checked = 0
    for where, argv in all_commands():
        if is_program(argv, "vllm") and argv[1:2] == ["serve"]:
            args = argv[2:]
            if any(a.startswith("$") for a in args):
                continue  # a config held in a shell variable: nothing literal to check
            try:
                parser.parse_args(args)
            except SystemExit as error:  # argparse reports and exits
                pytest.fail(f"{where}: vllm serve rejects {shlex.join(argv)!r} ({error})")
            checked += 1
    assert checked >= 1, "no literal `vllm serve` line found"


# -- store URLs ---------------------------------------------------------------------------------------------------

_URL_CHARS = r"[^\s`'\"|)<>\]]"
_URL_RE = re.compile(
    rf"faulty\+(?:<[^>\n]*>|{_URL_CHARS}){_URL_CHARS}*"  # faulty+URL..., faulty+<any URL>?...
    rf"|(?<![\w+])(?:file|memory|mooncake)://{_URL_CHARS}+"  # not a bare `file://` scheme mention
)
#: Placeholder parameter values used in the docs, and the sample value each stands for.
_PLACEHOLDER_VALUES = {"P": "0.1", "N": "1", "S": "7", "SIZE": "64KiB"}


def store_urls() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for path in DOC_FILES:
        # Python blocks are executed instead (their URLs may be f-strings).
        text = "\n".join([prose_of(path), *(b.text for b in blocks_of(path) if b.lang != "python")])
        for match in _URL_RE.finditer(text):
            url = match.group(0).rstrip(".,;:").removesuffix("?")
            found.setdefault(url, str(path.relative_to(ROOT)))
    return sorted((where, url) for url, where in found.items())


STORE_URLS = store_urls()


def concrete_url(url: str, file_dir: Path) -> str:
    """The URL with its placeholders replaced by sample values and any directory moved to ``file_dir``."""
    prefix = ""
    if url.startswith("faulty+"):
        prefix, url = "faulty+", url[len("faulty+") :]
        if m := re.fullmatch(r"(<[^>]*>|URL)(.*)", url):
            url = "memory://doc-inner" + m.group(2)
    base, sep, query = url.partition("?")
    if query == "...":
        sep = query = ""
    scheme, _, rest = base.partition("://")
    if scheme == "file" and rest.startswith(("/", "$")):  # an absolute directory, or one under $VARIABLE
        base = f"file://{file_dir}"
    elif scheme == "mooncake":
        host, _, port = rest.rpartition(":")
        host = "127.0.0.1" if re.fullmatch(r"[A-Z_]+", host) else host
        port = "50051" if re.fullmatch(r"[A-Z_]+", port) else port
        base = f"mooncake://{host}:{port}"
    elif scheme == "memory" and re.fullmatch(r"[A-Z_]+", rest):
        base = "memory://doc-name"
    query = re.sub(
        r"=([A-Z]+)(?=&|$)", lambda m: "=" + _PLACEHOLDER_VALUES.get(m.group(1), m.group(1)), query
    )
    return f"{prefix}{base}{sep}{query}"


class FakeMooncakeBackend:
    """Stands in for ``MooncakeBackend``: records the parsed options instead of connecting."""

    created: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, url: str, master_address: str, **options: Any) -> None:
        self.url = url
        FakeMooncakeBackend.created.append({"url": url, "master": master_address, **options})

    def close(self) -> None:
        pass


@pytest.fixture
def fake_mooncake(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import hybridkv.store.mooncake as mooncake_module

    FakeMooncakeBackend.created = []
    monkeypatch.setattr(mooncake_module, "MooncakeBackend", FakeMooncakeBackend)
    return FakeMooncakeBackend.created


def round_trip(store: Any) -> None:
    key, value = "hkv1/doc-test/000000000000/g0/tp0/dcp0/00", b"doc example bytes"
    assert store.put([key], [value]) == [Status.OK]
    assert store.exists([key]) == [Status.OK]
    out = bytearray(len(value))
    assert store.get_into([key], [out]) == [Status.OK]
    assert bytes(out) == value
    assert store.remove([key]) == [Status.OK]


def test_store_urls_are_found() -> None:
    schemes = {url.split("://")[0].split("+")[0] for _, url in STORE_URLS}
    assert {"file", "memory", "mooncake", "faulty"} <= schemes, f"URL extractor found only {schemes}"


@pytest.mark.parametrize(("where", "url"), STORE_URLS, ids=[u for _, u in STORE_URLS])
def test_store_url(where: str, url: str, tmp_path: Path, fake_mooncake: list[dict[str, Any]]) -> None:
    concrete = concrete_url(url, tmp_path / "store")
    store = open_store(concrete)  # raises StoreError naming any bad scheme, parameter or value
    try:
        if concrete.startswith("mooncake://"):
            assert len(fake_mooncake) == 1, f"{where}: {url} did not reach the Mooncake backend"
        elif not concrete.startswith("faulty+"):
            round_trip(store)
    finally:
        store.close()


# -- hybridkv command lines ---------------------------------------------------------------------------------------


def hybridkv_commands() -> list[tuple[str, list[str]]]:
    return [(where, argv) for where, argv in all_commands() if is_program(argv, "hybridkv")]


HYBRIDKV_COMMANDS = hybridkv_commands()


def parse_hybridkv(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args: argparse.Namespace = parser.parse_args(argv)
            return args
    except SystemExit:
        pytest.fail(f"hybridkv rejects {shlex.join(['hybridkv', *argv])!r}: {stderr.getvalue().strip()}")


def test_hybridkv_commands_are_found() -> None:
    assert len(HYBRIDKV_COMMANDS) >= 5, "hybridkv command extractor found almost nothing"


@pytest.mark.parametrize(
    ("where", "argv"), HYBRIDKV_COMMANDS, ids=[shlex.join(a) for _, a in HYBRIDKV_COMMANDS]
)
def test_hybridkv_command(where: str, argv: list[str]) -> None:
    args = parse_hybridkv(argv[1:])
    assert getattr(args, "func", None) is not None, f"{where}: {shlex.join(argv)} names no runnable command"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@functools.cache
def source_strings() -> frozenset[str]:
    """Every string literal in src/ (log messages and log event names among them)."""
    found: set[str] = set()
    for source in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return frozenset(found)


def test_inline_hybridkv_mentions_are_commands_or_log_messages() -> None:
    """`hybridkv audit` in prose names a real subcommand; `hybridkv lookup failed; ...` is a real log message."""
    checked = 0
    for path in DOC_FILES:
        for code in inline_code(path):
            if not code.startswith("hybridkv "):
                continue
            checked += 1
            words = shlex.split(code)[1:]
            if words[0] not in _subcommands(build_parser()):
                assert code in source_strings(), (
                    f"{path.name}: `{code}` is neither a subcommand nor a log message"
                )
                continue
            parser = build_parser()
            for word in words:
                choices = _subcommands(parser)
                if word.startswith("-") or not choices:
                    break
                assert word in choices, (
                    f"{path.name}: `{code}`: no subcommand {word!r} (have {sorted(choices)})"
                )
                parser = choices[word]
    assert checked >= 1


def test_log_event_names_exist() -> None:
    """Store log events named in the docs (`store.corrupt_value`, ...) are emitted by the code."""
    mentioned = {
        code for path in DOC_FILES for code in inline_code(path) if re.fullmatch(r"store\.[a-z_.]+", code)
    }
    assert mentioned, "no log event mentioned"
    assert mentioned <= source_strings(), (
        f"unknown log events in the docs: {sorted(mentioned - source_strings())}"
    )


def log_call_fields(message: str) -> set[str]:
    """Keyword fields of the ``log.<level>(message, field=...)`` calls in src/ that write ``message``."""
    fields: set[str] = set()
    for source in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == message
            ):
                fields.update(k.arg for k in node.keywords if k.arg)
    return fields


def test_failed_load_log_fields_are_documented() -> None:
    """The failed-load row of docs/failure-semantics.md names every field of the log line the scheduler writes."""
    message = "hybridkv load failed; request recomputes"
    fields = log_call_fields(message) - {"request_id"}
    assert {"boundary", "retry_cap"} <= fields, f"log scan is broken: {sorted(fields)}"
    rows = [row for row in table_rows(DOCS / "failure-semantics.md", "event") if message in " ".join(row)]
    assert len(rows) == 1, f"docs/failure-semantics.md: no single summary row naming `{message}`"
    documented = set(names(rows[0][-1]))
    assert fields <= documented, f"failure-semantics.md: log fields {sorted(fields - documented)} not documented"


def test_retired_safe_boundary_name_is_gone() -> None:
    """The retry cap was called the "safe boundary" before it let the retry load an earlier boundary."""
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8").lower()
        for old in ("safe boundary", "safe_boundary", "safe prefix"):
            assert old not in text, f"{path.relative_to(ROOT)}: says {old!r}; the name is now the retry cap"

def test_make_targets_and_repository_paths_in_commands_exist() -> None:
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))
    for where, argv in all_commands():
        if is_program(argv, "make"):
            for target in argv[1:]:
                assert target in targets, f"{where}: make target {target!r} is not in the Makefile"
        for arg in argv:
            if re.match(r"^(scripts|tests|docs|src)/", arg):
                assert (ROOT / arg.split("::")[0]).exists(), f"{where}: {arg} does not exist"


# -- python snippets ----------------------------------------------------------------------------------------------


def python_blocks() -> list[tuple[Block, Block | None]]:
    """Each python block with the block that shows its output, if marked."""
    found = []
    for path in DOC_FILES:
        blocks = blocks_of(path)
        for i, block in enumerate(blocks):
            if block.lang == "python":
                nxt = blocks[i + 1] if i + 1 < len(blocks) else None
                found.append((block, nxt if nxt is not None and nxt.marker == "output" else None))
    return found


PYTHON_BLOCKS = python_blocks()


def localize_python(source: str, tmp_path: Path) -> str:
    """Point every file:// URL of a snippet into ``tmp_path``."""
    counter = iter(range(1000))
    return re.sub(
        r"file://(/[^?\"'\s]*)", lambda _m: f"file://{tmp_path / f'snippet-store-{next(counter)}'}", source
    )


@pytest.mark.parametrize(("block", "output"), PYTHON_BLOCKS, ids=[b.where for b, _ in PYTHON_BLOCKS])
def test_python_snippet(
    block: Block, output: Block | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "doc_snippet"}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(localize_python(block.text, tmp_path), block.where, "exec"), namespace)  # noqa: S102
    if output is not None:
        assert stdout.getvalue() == output.text, f"{block.where}: printed output differs from {output.where}"
    run_state_machine_tests(namespace)


def run_state_machine_tests(namespace: dict[str, Any]) -> None:
    """A snippet that builds a Hypothesis state-machine TestCase must also run (a few short, fixed examples: enough
    to catch a factory that does not give a fresh store per example)."""
    import unittest

    from hypothesis import HealthCheck, settings

    for value in list(namespace.values()):
        if isinstance(value, type) and issubclass(value, unittest.TestCase) and hasattr(value, "runTest"):
            value.settings = settings(  # type: ignore[attr-defined]
                max_examples=10,
                stateful_step_count=10,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            result = unittest.TestResult()
            value("runTest").run(result)
            assert result.wasSuccessful(), [str(e) for _, e in result.errors + result.failures]


# -- audit log examples ---------------------------------------------------------------------------------------------


def audit_examples() -> list[tuple[str, Block, Block]]:
    logs: dict[str, Block] = {}
    outputs: dict[str, Block] = {}
    for block in all_blocks():
        if block.marker and block.marker.startswith("audit-log "):
            logs[block.marker.split()[1]] = block
        elif block.marker and block.marker.startswith("audit-output "):
            outputs[block.marker.split()[1]] = block
    assert set(logs) == set(outputs), (
        f"audit-log / audit-output markers do not pair up: {set(logs) ^ set(outputs)}"
    )
    return [(name, logs[name], outputs[name]) for name in sorted(logs)]


AUDIT_EXAMPLES = audit_examples()


def test_audit_examples_are_found() -> None:
    assert AUDIT_EXAMPLES, "no marked audit-log example"


@pytest.mark.parametrize(("name", "log", "output"), AUDIT_EXAMPLES, ids=[n for n, _, _ in AUDIT_EXAMPLES])
def test_audit_example(
    name: str,
    log: Block,
    output: Block,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = output.text.splitlines()
    assert lines and lines[0].startswith("$ hybridkv audit "), (
        f"{output.where}: must start with `$ hybridkv audit FILE`"
    )
    argv = shlex.split(lines[0][2:])[1:]
    exit_code = int(re.search(r"exit=(\d+)", output.marker or "").group(1))  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)
    (tmp_path / argv[1]).write_text(log.text, encoding="utf-8")
    capsys.readouterr()
    assert cli_main(argv) == exit_code, f"{output.where}: exit code"
    printed = [line.rstrip() for line in capsys.readouterr().out.rstrip("\n").splitlines()]
    assert printed == [line.rstrip() for line in lines[1:]], (
        f"{output.where}: `hybridkv audit` prints otherwise"
    )


def audit_scenario() -> list[dict[str, Any]]:
    """The story docs/lifecycle.md tells for its `ok` log, played on the real lifecycle machine.

    Full attention (16 tokens/block, DCP-sharded) + Mamba (64), TP=2, DCP=2, 100-token prompts: req-a misses and
    saves its prompt (save job 1); req-b hits and verifies; req-c hits, full-attention block 1 fails on rank 1,
    the one retry looks up again under the cap, and the request finishes.
    """
    import hashlib

    from hybridkv.lifecycle.audit import MemoryAuditSink
    from hybridkv.lifecycle.geometry import Geometry, GroupSpec, KeyScheme, LoadOutcome, Topology, plan_save
    from hybridkv.lifecycle.machine import LifecycleMachine

    geometry = Geometry(
        groups=(GroupSpec.full(16), GroupSpec.mamba(64)), topology=Topology(tp_size=2, dcp_size=2)
    )
    scheme = KeyScheme(namespace="prod-a", model="tiny", geometry=geometry)
    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(8)]
    sink = MemoryAuditSink()
    machine = LifecycleMachine(scheme, sink=sink)
    stored: set[str] = set()

    def lookup(request: Any) -> Any:
        candidates = request.start_lookup(hashes, 100, 0)
        return None if candidates is None else request.finish_lookup([k in stored for k in candidates.keys])

    a = machine.new_request("req-a")
    lookup(a)
    wave = machine.new_save_wave("req-a", 1, plan_save(scheme, hashes, {0: [32, 64, 96], 1: [96]}))
    wave.start_put()
    wave.finish_put({entry: True for entry, _ in wave.plan.entries})
    stored |= {key for _, key in wave.plan.entries}
    a.evict()
    b = machine.new_request("req-b")
    result = lookup(b)
    b.start_load()
    b.finish_load({entry: LoadOutcome.OK for entry, _ in result.plan.entries})
    b.evict()
    c = machine.new_request("req-c")
    result = lookup(c)
    c.start_load()
    outcomes = {entry: LoadOutcome.OK for entry, _ in result.plan.entries}
    failed = next(e for e, _ in result.plan.entries if (e.tp_rank, e.group_index, e.block_index) == (1, 0, 1))
    outcomes[failed] = LoadOutcome.FAILED
    c.finish_load(outcomes)
    lookup(c)
    c.evict()
    records: list[dict[str, Any]] = sink.records
    return records


def test_ok_audit_example_is_what_the_machine_writes() -> None:
    """The `ok` log in docs/lifecycle.md is exactly what the lifecycle writes for the story it tells."""
    log = next(block for name, block, _ in AUDIT_EXAMPLES if name == "ok")
    shown = [json.loads(line) for line in log.text.splitlines() if line.strip()]
    written = audit_scenario()
    for record in (*shown, *written):
        record.pop("monotonic")
    assert shown == written, (
        f"{log.where}: regenerate the example from audit_scenario() in {Path(__file__).name}"
    )


def test_violation_kinds_table() -> None:
    """docs/lifecycle.md's violation table lists exactly the kinds `hybridkv audit` can report."""
    import hybridkv.lifecycle.audit as audit_module

    kinds = set()
    for node in ast.walk(ast.parse(Path(audit_module.__file__).read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "Violation"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            kinds.add(node.args[0].value)
    documented = {names(row[0])[0] for row in table_rows(DOCS / "lifecycle.md", "violation")}
    assert documented == kinds, f"violation kinds: missing {kinds - documented}, extra {documented - kinds}"


def test_detail_fields_table() -> None:
    """docs/lifecycle.md's `detail` table lists exactly the fields each trigger's record carries."""
    import hybridkv.lifecycle.machine as machine_module

    fields: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(Path(machine_module.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fire":
            trigger = node.args[1] if len(node.args) > 1 else None
            if isinstance(trigger, ast.Constant) and isinstance(trigger.value, str) and node.keywords:
                fields.setdefault(trigger.value, set()).update(k.arg for k in node.keywords if k.arg)
    documented = {
        names(row[0])[0]: set(names(row[1])) for row in table_rows(DOCS / "lifecycle.md", "trigger")
    }
    assert documented == fields, f"detail fields: docs {documented}, code {fields}"


def audit_records() -> list[tuple[str, dict[str, Any]]]:
    """Single audit records shown in JSON blocks (not the marked logs, which are replayed whole)."""
    found = []
    for block in all_blocks():
        if block.lang != "json" or block.marker is not None:
            continue
        obj = json.loads(block.text)
        if isinstance(obj, dict) and "trigger" in obj:
            found.append((block.where, obj))
    return found


def test_json_blocks_are_all_checked() -> None:
    """A new kind of JSON example must get a check here: every JSON block is a known kind."""
    for block in all_blocks():
        if block.lang != "json" or block.marker is not None:
            continue
        obj = json.loads(block.text)
        assert isinstance(obj, dict) and ("trigger" in obj or "kv_connector" in obj or "schema" in obj), (
            f"{block.where}: JSON example of unknown kind; add a check for it in {Path(__file__).name}"
        )


def test_trace_record_examples() -> None:
    """Lifecycle-trace records (`hybridkv audit --export vllm-trace`) parse as the exporter's schema."""
    from hybridkv.lifecycle.trace import parse_trace_line

    num_checked = 0
    for block in all_blocks():
        if block.lang == "json" and block.marker is None and '"schema"' in block.text:
            parse_trace_line(" ".join(block.text.split("\n")))
            num_checked += 1
    assert num_checked >= 1, "no lifecycle-trace example found"


@pytest.mark.parametrize(("where", "record"), audit_records(), ids=[w for w, _ in audit_records()])
def test_audit_record_example(where: str, record: dict[str, Any]) -> None:
    assert set(record) == {"event", *RECORD_KEYS}, f"{where}: fields differ from the audit record's"
    spec = transition_index().get((record["trigger"], State[record["src"]]))
    assert spec is not None, f"{where}: {record['trigger']} is not a transition from {record['src']}"
    assert spec.dest.name == record["dst"], f"{where}: {record['trigger']} leads to {spec.dest.name}"
    assert spec.event == record["event"], f"{where}: that transition's event is {spec.event}"


# -- lifecycle tables and diagram -------------------------------------------------------------------------------------


def table_rows(path: Path, first_header: str) -> list[list[str]]:
    """Cells of the rows of every table whose first header cell is ``first_header``."""
    rows: list[list[str]] = []
    in_table = False
    for line in prose_of(path).splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not in_table:
            in_table = cells[0] == first_header
            continue
        if set(cells[0]) <= {"-", ":"}:
            continue
        rows.append(cells)
    return rows


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_lifecycle_states_table() -> None:
    rows = table_rows(DOCS / "lifecycle.md", "state")
    documented = [names(row[0])[0] for row in rows]
    assert sorted(documented) == sorted(s.name for s in State), "docs/lifecycle.md states table != State"


def test_lifecycle_transitions_table() -> None:
    rows = table_rows(DOCS / "lifecycle.md", "event")
    documented = {
        (names(trigger)[0], frozenset(names(sources)), names(dest)[0], names(event)[0], tuple(names(guard)))
        for event, trigger, sources, dest, guard, *_ in rows
    }
    table = {
        (t.trigger, frozenset(s.name for s in t.sources), t.dest.name, t.event, t.conditions)
        for t in TRANSITIONS
    }
    assert documented == table, (
        f"docs/lifecycle.md transitions differ from TRANSITIONS: missing {table - documented}, extra {documented - table}"
    )


def test_mermaid_blocks_match_the_table() -> None:
    mermaid = [block for block in all_blocks() if block.lang == "mermaid"]
    assert mermaid, "no mermaid diagram in the docs"
    for block in mermaid:
        assert block.text == render_mermaid(), (
            f"{block.where}: stale diagram (copy docs/diagrams/lifecycle.mmd)"
        )


# -- README configuration table ---------------------------------------------------------------------------------------


def test_readme_config_table_matches_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = {names(row[0])[0]: row[1] for row in table_rows(README, "key")}
    assert sorted(rows) == sorted(KNOWN_KEYS), "README kv_connector_extra_config table != KNOWN_KEYS"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = "/models/Qwen3-Next-80B-A3B-Instruct"
    defaults = ConnectorConfig.from_extra_config({}, model=model)
    for key, cell in rows.items():
        shown = names(cell)[0] if names(cell) else cell
        actual = getattr(defaults, key)
        if key == "store":
            assert shown.replace("$XDG_CACHE_HOME", str(tmp_path)) == actual == default_store_url(), cell
        elif key == "namespace":
            assert actual == Path(model).name and "folder name" in cell, cell
        elif key == "audit_log":
            assert actual is None and shown == "none", cell
        elif key == "put_wave_bytes":
            assert parse_size(key, shown) == actual, cell
        elif key == "verify_checksums":
            assert json.loads(shown) is actual, cell
        else:
            assert float(shown) == actual, f"{key}: README says {cell}, code {actual}"


# -- metrics ------------------------------------------------------------------------------------------------------------


def emitted_stat_names() -> set[str]:
    """Names the connector puts into its stats: ``*.stats.add("name", ...)`` and ``stats.data["name"] = ...``."""
    found: set[str] = set()
    for source in sorted((ROOT / "src" / "connector").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            name_node = None
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add"
                and "stats" in ast.unparse(node.func.value)
                and node.args
            ):
                name_node = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("stats.data"):
                name_node = node.slice
            if isinstance(name_node, ast.Constant) and isinstance(name_node.value, str):
                found.add(name_node.value)
            elif isinstance(name_node, ast.JoinedStr):
                found.add(
                    "".join(str(v.value) if isinstance(v, ast.Constant) else "<N>" for v in name_node.values)
                )
    return found


def metrics_rows() -> dict[str, tuple[str, str]]:
    """stats key -> (Prometheus series, type) from docs/metrics.md's table."""
    return {
        names(row[0])[0]: (names(row[1])[0], row[2]) for row in table_rows(DOCS / "metrics.md", "stats key")
    }


def test_every_emitted_stat_is_documented() -> None:
    emitted = emitted_stat_names()
    assert {"lookups", "load_keys", "save_keys"} <= emitted, f"stats scan is broken: {sorted(emitted)}"
    missing = emitted - set(metrics_rows())
    assert not missing, f"docs/metrics.md does not document {sorted(missing)}"


@pytest.mark.vllm
def test_metrics_doc_matches_the_exported_series() -> None:
    """Build the connector's Prometheus metrics on a private registry and compare with the docs table."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from hybridkv.connector import stats
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = stats.build_prom(
        SimpleNamespace(kv_transfer_config=None),
        metric_types,
        ["model_name", "engine"],
        {0: ["doc-model", "0"]},
    )
    rows = metrics_rows()
    documented_keys = set(rows)
    exported_keys = {*stats.PROM_COUNTERS, *getattr(stats, "GAUGES", {}), "hit_tokens.g<N>"}
    assert documented_keys == exported_keys, (
        f"docs/metrics.md keys differ: missing {exported_keys - documented_keys}, extra {documented_keys - exported_keys}"
    )
    prom.observe({key.replace("<N>", "0"): 1 for key in documented_keys}, 0)
    exposition = generate_latest(registry).decode()
    series = {
        m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\w+)$", exposition, flags=re.MULTILINE)
    }
    for key, (documented, kind) in rows.items():
        base = documented.split("{")[0]
        # (the TYPE line names a counter with or without `_total`, depending on prometheus_client's version)
        assert kind in (series.get(base), series.get(base.removesuffix("_total"))), (
            f"{key}: {documented} ({kind}) is not exported; exported {series}"
        )
        assert re.search(rf"^{re.escape(base)}\{{", exposition, flags=re.MULTILINE), (
            f"{key}: no sample of {base}"
        )
        for label in re.findall(r"(\w+)=", documented):
            assert re.search(rf"^{re.escape(base)}\{{[^}}]*\b{label}=", exposition, flags=re.MULTILINE), (
                f"{key}: {base} has no label {label}"
            )
    exposed = set(re.findall(r"^(vllm:hybridkv_\w+?)\{", exposition, flags=re.MULTILINE))
    for block in all_blocks():
        if block.lang == "promql":
            for name in re.findall(r"vllm:hybridkv_\w+", block.text):
                assert name in exposed, f"{block.where}: {name} is not an exported series"


# -- links ----------------------------------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose_of(path), flags=re.MULTILINE)}


def iter_links() -> Iterator[tuple[Path, str]]:
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose_of(path)):
            if not re.match(r"^[a-z]+:", target):
                yield path, target


def test_relative_links_resolve() -> None:
    for path, target in iter_links():
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name}: link to missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors_of(linked), f"{path.name}: no heading #{anchor} in {linked.name}"


def test_readme_links_every_doc() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for path, target in iter_links()
        if path == README
    }
    for doc in sorted(DOCS.glob("*.md")):
        assert doc.resolve() in linked, f"README.md does not link {doc.relative_to(ROOT)}"


def test_doc_files_exist() -> None:
    for name in ("lifecycle.md", "keys.md", "failure-semantics.md", "metrics.md", "operations.md"):
        assert (DOCS / name).is_file(), name


@pytest.mark.vllm
def test_documented_hit_sources() -> None:
    """docs/metrics.md's `source` per store scheme is what the connector reports to vLLM."""
    pytest.importorskip("vllm")
    from hybridkv.connector import connector

    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    pairs = re.findall(r"`(\w+)` for `(\w+)://`", text)
    assert {scheme for _, scheme in pairs} == {"file", "memory", "mooncake"}, pairs
    for source, scheme in pairs:
        for url in (f"{scheme}://x", f"faulty+{scheme}://x"):
            assert connector.hit_source(url).value == source, f"{url}: docs say {source}"
