"""README.md's staging walk-through (Pre-flight, Serve, Verify), run as a user types it.

The fenced blocks marked ``<!-- doc-test: readme-run try-it -->`` are taken from README.md in order and run, exactly
as written, by one ``bash`` in a fresh working directory (one shell for all of them, like a terminal the user
pastes them into: ``EXTRA``, ``SERVER_PID`` and the function ``complete`` carry over), with ``MODEL`` a tiny
random-weight Qwen3-Next the project builds (it has a real tokenizer), the venv's ``bin`` first on ``PATH``,
``XDG_CACHE_HOME`` in a temp folder (the connector's default store lives there) and ``HF_HUB_OFFLINE=1``. Between
blocks the test only echoes a separator with the block's exit status. A fast test checks that the marked blocks are
the ones under the README's Pre-flight, Serve and Verify headings, holding their commands.

Asserted on outcomes: the pre-flight ``hybridkv describe`` printed the store and, before the first start, said it
does not exist yet (exit 1); the server became healthy; the completion before and after the prefix-cache reset
gave the same non-empty text; ``/metrics`` showed external prefix-cache hits and hybridkv hit tokens above 0; the
audit log exists and ``hybridkv audit`` (run by the README) exited 0; the README's stop step left no process of
the server behind (the test kills any it finds, and fails). The README names port 8000: the suite runs in a
private network namespace (``scripts/netns-run``) where it is free; elsewhere a busy port fails the test at once.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from support.docs import README, Block, blocks_of

MARKER = "readme-run try-it"
PORT = 8000  # the README's
SCRIPT_TIMEOUT_S = 540.0  # the whole walk-through; below the test's own timeout so the cleanup still runs
_SEPARATOR = re.compile(r"^@@readme-block (\d+) rc=(\d+)@@$", flags=re.MULTILINE)


def try_it_blocks() -> list[Block]:
    return [block for block in blocks_of(README) if block.marker == MARKER]


#: The README section each marked block stands in, and a command it must hold: the pre-flight, the CPU serve
#: form, the verify steps and the stop with the audit replay are the blocks run, not copies of them.
EXPECTED_BLOCKS = (
    ("Pre-flight", "hybridkv describe --config"),
    ("Serve", "python -m vllm.entrypoints.openai.api_server --model"),
    ("Verify (staging)", "/reset_prefix_cache"),
    ("Verify (staging)", "hybridkv audit audit.jsonl"),
)


def section_of(block: Block) -> str:
    """The ``## `` heading the block sits under."""
    lines = README.read_text(encoding="utf-8").splitlines()[: block.line - 1]
    headings = [line[3:].strip() for line in lines if line.startswith("## ")]
    return headings[-1] if headings else ""


def test_readme_runs_the_pre_flight_serve_and_verify_blocks() -> None:
    """Cheap, and not slow: the marked blocks are the README's pre-flight, serve and verify steps, in order."""
    blocks = try_it_blocks()
    assert len(blocks) == len(EXPECTED_BLOCKS), f"README.md: {len(blocks)} blocks marked {MARKER!r}"
    for block, (heading, command) in zip(blocks, EXPECTED_BLOCKS, strict=True):
        assert section_of(block) == heading, (
            f"{block.where}: under '## {section_of(block)}', not '## {heading}'"
        )
        assert command in block.text, (
            f"{block.where}: the block under '## {heading}' does not run {command!r}"
        )


def script_of(blocks: list[Block]) -> str:
    """The blocks as written, each followed by a separator line that carries its last command's exit status."""
    parts = [f'{block.text}echo "@@readme-block {i} rc=$?@@"\n' for i, block in enumerate(blocks)]
    return "".join(parts)


def outputs_of(text: str, count: int) -> list[tuple[int, str]]:
    """(exit status, output) of each block, from the script's output."""
    found: list[tuple[int, str]] = []
    start = 0
    for match in _SEPARATOR.finditer(text):
        assert int(match.group(1)) == len(found), f"separator out of order: {match.group(0)}"
        found.append((int(match.group(2)), text[start : match.start()]))
        start = match.end()
    assert len(found) == count, (
        f"only {len(found)} of {count} README blocks finished; output:\n{text[-4000:]}"
    )
    return found


def metric_values(text: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)]


def require_free_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))  # the server binds all interfaces by default
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            pytest.fail(
                f"port {port} (the README's) is in use on this host: run the test under scripts/netns-run "
                "(a private network namespace), as `make test` does, or free the port"
            )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(720)
def test_readme_try_it_commands_run_as_written(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: the README's commands use it")
    blocks = try_it_blocks()
    assert len(blocks) == len(EXPECTED_BLOCKS), (
        f"README.md: expected 4 blocks marked {MARKER!r}, found {len(blocks)}"
    )
    require_free_port(PORT)
    model = build_tiny_model("qwen3_next", DEFAULT_MODELS_DIR)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    for name in (
        "VLLM_SERVER_DEV_MODE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "SERVER_PID",
        "EXTRA",
        "KV_CONFIG",
    ):
        env.pop(name, None)  # the README sets what it needs
    env.update(
        MODEL=str(model),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    script = work.parent / "readme-try-it.sh"
    script.write_text(script_of(blocks))
    out_path = tmp_path / "readme-output.txt"
    started = time.monotonic()
    with out_path.open("wb") as out:
        # Its own process group: the server started in the background is in it, so the cleanup finds it.
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    left_behind = False
    try:
        try:
            proc.wait(SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the README's commands did not finish in {SCRIPT_TIMEOUT_S:.0f} s:\n{tail(out_path)}"
            )
        deadline = time.monotonic() + 15  # the engine core may take a moment after the server's exit
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left_behind = group_alive(proc.pid)
    finally:
        if proc.poll() is None or group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    elapsed = time.monotonic() - started
    text = out_path.read_text(errors="replace")
    print(f"README try-it commands ran in {elapsed:.0f} s\n{text[-3000:]}")
    results = outputs_of(text, len(blocks))
    server_log = work / "vllm.log"
    log_tail = tail(server_log) if server_log.exists() else "(no vllm.log)"

    (describe_rc, describe_out), (_, serve_out), (_, verify_out), (stop_rc, stop_out) = results
    store = tmp_path / "cache" / "hybridkv" / "store"
    assert re.search(rf"^store\s+file://{re.escape(str(store))}\b", describe_out, re.MULTILINE), describe_out
    assert describe_rc == 1 and "no file store" in describe_out, (
        f"before the first start describe should say the store does not exist yet (exit 1): rc={describe_rc}\n"
        f"{describe_out}"
    )
    assert "server healthy" in serve_out, f"the server did not become healthy:\n{serve_out}\n{log_tail}"

    first = (work / "first.txt").read_text()
    second = (work / "second.txt").read_text()
    assert first.strip("\n"), f"the first completion gave no text:\n{verify_out}\n{log_tail}"
    assert first == second, f"the completions differ: {first!r} != {second!r}"
    assert "same text:" in verify_out, verify_out
    external_hits = metric_values(verify_out, "vllm:external_prefix_cache_hits_total")
    hit_tokens = metric_values(verify_out, "vllm:hybridkv_hit_tokens_total")
    assert external_hits and sum(external_hits) > 0, f"no external prefix-cache hits:\n{verify_out}"
    assert hit_tokens and sum(hit_tokens) > 0, f"no hybridkv hit tokens:\n{verify_out}"

    assert (work / "audit.jsonl").is_file(), (
        f"no audit log in {work}: {sorted(p.name for p in work.iterdir())}"
    )
    assert stop_rc == 0, f"`hybridkv audit audit.jsonl` exited {stop_rc}:\n{stop_out}"
    assert not left_behind, "the README's stop step left server processes running (the test killed them)"


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
