"""Real vLLM (CPU build): a store get that answers ``TIMEOUT`` and writes the KV pages later never
touches a page after its load was reported, and the tokens stay identical.

``faulty+...?get_late=1&late_ms=N`` answers every get with ``TIMEOUT`` at once and writes the destination
pages ``N`` ms later -- with a garbage pattern (``late_scribble``), so a write landing after vLLM freed and
reused the blocks is visible. A store that can answer late never gets the KV pages themselves: the worker reads
into private buffers, so the load is reported (failed) at once while the late writes are still pending, and they
land in quarantined memory. The test watches the worker's real KV tensors: no page of a reported load may turn
into the scribble afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hybridkv.audit.replay import audit_file
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv.store.faulty import SCRIBBLE_BYTE, FaultyBackend
from support.engines import MODELS_DIR, connectors, engine, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT_LEN = 300
LATE_MS = 2500  # longer than the retry takes: the write lands on blocks the request is done with


def _scribbled(page: torch.Tensor) -> bool:
    return bool((page.contiguous().view(torch.uint8) == SCRIBBLE_BYTE).all())


def _watch_reports(worker_side: Any) -> tuple[list[tuple[torch.Tensor, bool]], list[int]]:
    """Hook the worker: for every load it reports, remember each of its pages and whether it was scribbled
    at that moment, and how many late store operations were still pending then (any one may still write
    the pages vLLM is about to free). Returns the two lists the hooks fill."""
    jobs: dict[str, Any] = {}
    pages: list[tuple[torch.Tensor, bool]] = []
    pending_at_report: list[int] = []
    faulty = worker_side.store.backend
    assert isinstance(faulty, FaultyBackend), type(faulty).__name__
    start_load, transfer_results = worker_side.start_load, worker_side.transfer_results

    def recording_start_load(meta: Any) -> None:
        jobs.update((job.req_id, job) for job in meta.loads)
        start_load(meta)

    def snapshotting_transfer_results() -> tuple[set[str], set[str]]:
        done, failed = transfer_results()
        if done:
            pending_at_report.append(faulty.num_late_pending)
        for request_id in done:
            for ref in jobs.pop(request_id).blocks:
                for tensor in worker_side.group_tensors(ref.group_index):
                    page = tensor[ref.block_id]
                    pages.append((page, _scribbled(page)))
        return done, failed

    worker_side.start_load = recording_start_load
    worker_side.transfer_results = snapshotting_transfer_results
    return pages, pending_at_report


def test_late_get_never_writes_a_reported_page_and_tokens_stay_identical(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_next", MODELS_DIR)
    extra = {
        "store": f"faulty+file://{tmp_path}/store?capacity=256MiB&get_late=1&late_ms={LATE_MS}",
        "lookup_budget_ms": 5000,
        "audit_log": str(tmp_path / "audit.jsonl"),
    }
    tokens = prompt(PROMPT_LEN, seed=5)
    with engine(model, extra) as llm:
        cold, _ = generate(llm, tokens)
        reset_local_cache(llm)
        _, worker = connectors(llm)
        pages, pending_at_report = _watch_reports(worker.worker_side)
        warm, cached = generate(llm, tokens, max_tokens=16)
        time.sleep(LATE_MS / 1000 + 0.5)  # any late write has landed by now
        late_after_report = [
            i for i, (page, at_report) in enumerate(pages) if _scribbled(page) and not at_report
        ]
        w_tot = dict(worker.worker_side.stats.totals)
        num_late_calls = getattr(worker.worker_side, "num_late_store_calls", 0)
        again, _ = generate(llm, tokens, max_tokens=16)
    assert pages, "no load was reported: the test did not exercise a late get"
    assert pending_at_report and pending_at_report[0] >= 1, (
        f"the report waited for the late gets (it need not: they own private buffers): {pending_at_report}"
    )
    assert not late_after_report, (
        f"{len(late_after_report)} KV pages were written after their load was reported"
    )
    assert num_late_calls >= 1 and w_tot["load_failed_keys"] > 0
    assert cached == 0
    assert warm[: len(cold)] == cold and again == warm, "tokens differ after a late get"
    # The audit taken under late calls replays against the table: legal, every lifecycle terminated.
    report = audit_file(tmp_path / "audit.jsonl")
    assert report.ok and report.num_truncations >= 1, report.to_dict()["violations"]
