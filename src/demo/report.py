"""The demo's report for an operator: one table and its checks per phase, the audit, the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.demo.scenario import DemoReport, PhaseResult, RequestResult
from hybridkv.tables import format_table

__all__ = ["render"]

_COLUMNS = [
    "request",
    "prompt",
    "cached",
    "local",
    "external",
    "loaded",
    "saved",
    "truncated",
    "failed keys",
    "tokens",
]


def _size(n: int) -> str:
    if n <= 0:
        return "0"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _tokens_cell(r: RequestResult, phase: PhaseResult) -> str:
    if r.tokens_match is None:
        return "reference" if phase.name == "cold" else "-"
    return "same" if r.tokens_match else "DIFFERENT"


def _row(r: RequestResult, phase: PhaseResult) -> dict[str, Any]:
    return {
        "request": r.label,
        "prompt": r.prompt_tokens,
        "cached": r.cached_tokens,
        "local": r.local_hit_tokens,
        "external": r.external_hit_tokens,
        "loaded": _size(r.loaded_bytes),
        "saved": _size(r.saved_bytes),
        "truncated": r.truncations,
        "failed keys": r.failed_keys,
        "tokens": _tokens_cell(r, phase),
    }


def render(report: DemoReport, summary_path: Path | None = None) -> str:
    """The operator-facing text: a header, one table and its checks per phase, the audit, the verdict."""
    lines: list[str] = []
    geo = report.geometry
    lines.append(f"hybridkv demo: tiny random-weight {report.model_family} model on vLLM (in-process)")
    lines.append(f"  store      {report.store}")
    lines.append(f"  chaos      {report.chaos_store}")
    lines.append(f"  namespace  {report.namespace}")
    if geo:
        lines.append(f"  groups     {'; '.join(geo.get('groups', []))}")
        lines.append(f"  hits align to {geo.get('hit_alignment')} tokens (hash unit {geo.get('hash_unit')})")
    lines.append(
        "  columns    cached = vLLM's num_cached_tokens = local (device prefix cache) + external (loaded "
        "from the store and verified); loaded / saved = bytes read from / written to the store (bytes "
        "read for a truncated load are discarded); failed keys = reads that failed or were corrupt"
    )
    for number, phase in enumerate(report.phases, start=1):
        lines.append("")
        verdict = "ok" if phase.ok else "FAILED"
        lines.append(f"{number}. {phase.title}  [{verdict}]")
        if phase.requests:
            table = format_table([_row(r, phase) for r in phase.requests], _COLUMNS)
            lines.extend("   " + line for line in table.splitlines())
        lines.extend(
            f"   {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}" for check in phase.checks
        )
    lines.append("")
    audit = report.audit
    if audit is None:
        lines.append("audit: not run")
    elif "error" in audit:
        lines.append(f"audit: FAILED: {audit['error']}")
    else:
        counts = audit.get("violation_counts") or {}
        lines.append(
            f"audit: {report.audit_log}: {audit.get('num_records')} records, {audit.get('num_lifecycles')} "
            f"lifecycles, {audit.get('num_truncations')} truncations, {audit.get('num_retries')} retries, "
            f"{len(audit.get('violations', []))} violations -> {'clean' if report.audit_ok else 'NOT CLEAN'}"
        )
        if counts:
            lines.append(f"   violations by kind: {counts}")
        lines.extend(
            f"   line {v.get('line')}: {v.get('kind')} {v.get('request_id')}: {v.get('message')}"
            for v in audit.get("violations", [])[:5]
        )
        lines.append(f"   re-check: hybridkv audit {report.audit_log}")
    if report.error:
        lines.append(f"error: {report.error}")
    total = report.timings.get("total_s")
    lines.append(
        f"result: {'PASS' if report.ok else 'FAIL'}"
        + (f" in {total:.0f}s" if total is not None else "")
        + f"; work dir {report.workdir}"
        + (f"; summary {summary_path}" if summary_path else "")
    )
    return "\n".join(lines)
