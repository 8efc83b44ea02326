"""Every example in README.md and docs/*.md is executed or validated here, so the docs cannot rot. Facts a
single page states about the code are checked in that page's own file (``test_<page>_page.py``).

What is checked here, on every page, per kind of example:

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
- Relative links (and their ``#anchors``) resolve.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hybridkv.cli import build_parser
from hybridkv.cli import main as cli_main
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.stores import open_connector_store
from hybridkv.lifecycle.sink import RECORD_KEYS
from hybridkv.lifecycle.table import State, transition_index
from hybridkv.store import Status, StoreLogEvent, open_store
from support.docs import (
    DOC_FILES,
    ROOT,
    Block,
    all_blocks,
    all_commands,
    anchors_of,
    audit_examples,
    blocks_of,
    inline_code,
    is_program,
    iter_links,
    prose_of,
)

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
        base = f"memory://doc-name-{file_dir.parent.name}"  # one table per example: tables keep their quotas
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
                assert code in {event.value for event in ConnectorLogEvent}, (
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
    """Store log events named in the docs (`store.corrupt_value`, ...) are events the stores log."""
    mentioned = {
        code for path in DOC_FILES for code in inline_code(path) if re.fullmatch(r"store\.[a-z_.]+", code)
    }
    assert mentioned, "no log event mentioned"
    events = {event.value for event in StoreLogEvent}
    assert mentioned <= events, f"unknown log events in the docs: {sorted(mentioned - events)}"


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


def test_request_bodies_carry_session_hints_the_connector_takes() -> None:
    """A request body's ``kv_transfer_params`` shown in the docs: its session hint parses, unrefused."""
    from hybridkv.connector.scheduler.sessions import parse_session_hint

    bodies = [
        (block.where, json.loads(block.text))
        for block in all_blocks()
        if block.lang == "json" and block.marker is None and "kv_transfer_params" in json.loads(block.text)
    ]
    assert bodies, "no request body with kv_transfer_params in the docs"
    for where, body in bodies:
        hint, reason = parse_session_hint(body["kv_transfer_params"])
        assert hint is not None and reason is None, f"{where}: {reason}"


def test_json_blocks_are_all_checked() -> None:
    """A new kind of JSON example must get a check here: every JSON block is a known kind."""
    for block in all_blocks():
        if block.lang != "json" or block.marker is not None:
            continue
        obj = json.loads(block.text)
        known = ("trigger", "kv_connector", "schema", "kv_transfer_params")
        assert isinstance(obj, dict) and any(kind in obj for kind in known), (
            f"{block.where}: JSON example of unknown kind; add a check for it in {Path(__file__).name}"
        )


def test_trace_record_examples() -> None:
    """Lifecycle-trace records (`hybridkv audit --export vllm-trace`) parse as the exporter's schema."""
    from hybridkv.audit.trace import parse_trace_line

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


# -- links ----------------------------------------------------------------------------------------------------------------


def test_relative_links_resolve() -> None:
    for path, target in iter_links():
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name}: link to missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors_of(linked), f"{path.name}: no heading #{anchor} in {linked.name}"
