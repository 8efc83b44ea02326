"""docs/failure-semantics.md: the failed-load row names every field of the log line the scheduler writes."""

from __future__ import annotations

import ast

from doc_reader import DOCS, ROOT, names, table_rows


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
    assert fields <= documented, (
        f"failure-semantics.md: log fields {sorted(fields - documented)} not documented"
    )
