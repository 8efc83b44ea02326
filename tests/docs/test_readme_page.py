"""README.md is the operator's page: at most ``MAX_README_BYTES``; it names every install extra of pyproject.toml in
its install table, gives every ``kv_connector_extra_config`` key and store scheme its sentence (the paragraphs are
in docs/configuration.md), defines the glossary's terms, states the test command CI runs, and lists and links every
page under docs/. It never installs hybridkv by name from the package index, where it is not published."""

from __future__ import annotations

import re
import tomllib

from hybridkv.connector.config import KNOWN_KEYS
from hybridkv.store.url import FAULTY_PREFIX, STORE_KINDS
from support.docs import DOC_FILES, DOCS, README, ROOT, all_commands, iter_links, names, prose_of, table_rows

#: "About 10 KB": the operator's page stays one page; developer material goes to docs/development.md.
MAX_README_BYTES = 12 * 1024
GLOSSARY = ("boundary", "hash unit", "retry cap", "wave")


def section(heading: str) -> str:
    """The README's prose under ``## heading``, up to the next ``## ``."""
    text = prose_of(README)
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no section '## {heading}'"
    return match.group(1)


def test_readme_stays_an_operators_page() -> None:
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, (
        f"README.md is {size} bytes (at most {MAX_README_BYTES}): move developer or reference material to docs/"
    )


def test_readme_install_table_names_every_extra() -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    install = section("Install")
    mentioned = {word for code in names(install) for word in re.split(r"[^\w-]+", code)}
    assert extras <= mentioned, f"README Install names no {sorted(extras - mentioned)}"
    listed = set(re.findall(r"^- `([\w-]+)`", install, flags=re.MULTILINE))
    assert extras <= listed, f"README Install: no line for the extras {sorted(extras - listed)}"
    commands = [cell for row in table_rows(README, "host") for cell in row if cell.startswith("`pip install")]
    assert any('".[' in cell for cell in commands) and any("$WHEEL[" in cell for cell in commands), (
        "README install table: one command from a clone and one from a wheel per host and tier"
    )
    assert {row[0] for row in table_rows(README, "host")} == {"GPU", "CPU"}, (
        "README install table: GPU and CPU"
    )


def test_nothing_installs_hybridkv_from_the_index() -> None:
    """hybridkv is installed from a clone or a built wheel: ``pip install "hybridkv[...]"`` would ask the index."""
    pattern = re.compile(r"pip install [\"']?hybridkv\b")
    for path in DOC_FILES:
        assert not pattern.search(path.read_text(encoding="utf-8")), (
            f"{path.relative_to(ROOT)}: installs hybridkv from the package index, where it is not published"
        )


def test_readme_gives_every_config_key_and_store_scheme_a_sentence() -> None:
    configuration = section("Configuration")
    keys = re.findall(r"^- `(\w+)`:", configuration, flags=re.MULTILINE)
    assert sorted(keys) == sorted(KNOWN_KEYS), "README Configuration: one line per KNOWN_KEYS key, no other"
    assert "docs/configuration.md" in configuration
    for scheme in [*(f"{kind.scheme}://" for kind in STORE_KINDS.values()), FAULTY_PREFIX]:
        assert re.search(rf"^- `{re.escape(scheme)}", configuration, flags=re.MULTILINE), (
            f"README Configuration: no line for {scheme} store URLs"
        )


def test_readme_glossary() -> None:
    glossary = section("Glossary")
    defined = set(re.findall(r"\*\*([^*]+)\*\*", glossary))
    assert set(GLOSSARY) <= defined, f"README Glossary lacks {sorted(set(GLOSSARY) - defined)}"


def test_readme_states_the_test_command_ci_runs() -> None:
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert any(argv == ["make", "test"] for where, argv in all_commands() if where.startswith("README.md")), (
        "README.md must state `make test`, the command CI runs"
    )


def test_readme_links_every_doc() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for path, target in iter_links()
        if path == README
    }
    for doc in sorted(DOCS.glob("*.md")):
        assert doc.resolve() in linked, f"README.md does not link {doc.relative_to(ROOT)}"


def test_readme_docs_table_lists_every_doc_once() -> None:
    rows = table_rows(README, "page")
    listed = [target for row in rows for target in re.findall(r"\]\(([^)]+)\)", row[0])]
    pages = sorted(str(doc.relative_to(ROOT)) for doc in DOCS.glob("*.md"))
    assert sorted(listed) == pages, f"README Docs table lists {sorted(listed)}, docs/ holds {pages}"
    for row in rows:
        assert row[1].strip(), f"README Docs table: {row[0]} has no line saying what it holds"


def test_doc_files_exist() -> None:
    for name in (
        "lifecycle.md",
        "keys.md",
        "failure-semantics.md",
        "metrics.md",
        "operations.md",
        "configuration.md",
        "support-matrix.md",
        "development.md",
        "troubleshooting.md",
    ):
        assert (DOCS / name).is_file(), name
