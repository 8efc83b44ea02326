"""A small reader for the Markdown pages the doc tests check (README.md and docs/*.md): fenced code blocks
with their ``<!-- doc-test: ... -->`` markers, prose, inline code, shell commands, tables and links."""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOC_FILES = (README, *sorted(DOCS.glob("*.md")))

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
