"""The demo's engine: an in-process vLLM ``LLM`` with ``HybridStoreConnector`` (:class:`DemoEngine`), the
counters the demo reads from it, and the tail of its audit log (:class:`AuditTail`). One greedy request's
outcome is a :class:`RequestResult`; the phases that drive the engines are :mod:`hybridkv.demo.scenario`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.demo import vllm_harness
from hybridkv.ops import inprocess

__all__ = ["KV_CACHE_BYTES", "AuditTail", "DemoEngine", "RequestResult"]

#: KV-cache memory of the demo engine: ample for a few thousand tokens of the tiny models.
KV_CACHE_BYTES = 128 << 20


@dataclass
class RequestResult:
    """One greedy request and what the cache tiers did for it."""

    label: str
    prompt_tokens: int
    #: vLLM's ``num_cached_tokens``: prompt tokens not computed (local + external)
    cached_tokens: int
    local_hit_tokens: int
    #: tokens the connector loaded and verified for this request
    external_hit_tokens: int
    loaded_bytes: int
    saved_bytes: int
    truncations: int
    failed_keys: int
    #: True/False against the reference (the cold run of the same prompt); None: no reference
    tokens_match: bool | None
    output_tokens: list[int]
    seconds: float


class AuditTail:
    """Reads the records appended to the audit log since the previous call."""

    def __init__(self, path: Path, flush: Callable[[], object] | None = None) -> None:
        self.path = path
        # The sink writes on its own thread: flush first so "since the previous call" is exact.
        self._flush = flush
        self.offset = path.stat().st_size if path.exists() else 0

    def skip(self) -> None:
        if self._flush is not None:
            self._flush()
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        if self._flush is not None:
            self._flush()
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a partly written last line is read next time
        self.offset += end
        records = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records


class DemoEngine:
    """An in-process ``LLM`` with ``HybridStoreConnector`` (``hybridkv.demo.vllm_harness``), plus the
    counters the demo reads."""

    def __init__(
        self, model_dir: Path, store: str, namespace: str, audit_log: Path, max_model_len: int
    ) -> None:
        transfer = inprocess.connector_transfer_config(
            {
                "store": store,
                "namespace": namespace,
                "audit_log": str(audit_log),
            }
        )
        self._stack = contextlib.ExitStack()
        # The engine handle is reached into (in-process engine core, connector objects): typed loosely.
        self.llm: Any = self._stack.enter_context(
            inprocess.inprocess_engine(
                model_dir,
                transfer,
                **inprocess.engine_kwargs(max_model_len=max_model_len, kv_cache_bytes=KV_CACHE_BYTES),
                use_tqdm_on_load=False,
            )
        )
        try:
            self.sched_connector, self.worker_connector = inprocess.connector_halves(self.llm)
        except TypeError:
            self._stack.close()
            raise
        sink = self.sched_connector.scheduler_side.audit
        self.audit = AuditTail(audit_log, flush=sink.flush if sink is not None else None)

    # counters ------------------------------------------------------------------------------------
    def geometry(self) -> dict[str, Any]:
        return dict(self.sched_connector.scheduler_side.geo.describe())

    @property
    def hit_alignment(self) -> int:
        return int(self.sched_connector.scheduler_side.scheme.geometry.hit_alignment)

    def _totals(self) -> dict[str, float]:
        totals = dict(self.sched_connector.scheduler_side.stats.totals)
        for key, value in dict(self.worker_connector.worker_side.stats.totals).items():
            totals[key] = totals.get(key, 0) + value
        return totals

    # requests ------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Let queued saves finish (the worker writes them, the scheduler sees the results)."""
        vllm_harness.settle(self.llm)

    def drop_local_cache(self) -> None:
        """Empty vLLM's device prefix cache; the external store is kept."""
        vllm_harness.drop_local_cache(self.llm)
        self.audit.skip()

    def send(
        self, label: str, tokens: list[int], max_tokens: int, reference: list[int] | None
    ) -> RequestResult:
        """One greedy request, then settle its saves; the counters are this request's deltas."""
        self.audit.skip()
        before = self._totals()
        start = time.monotonic()
        out = vllm_harness.greedy(self.llm, tokens, max_tokens)
        seconds = time.monotonic() - start
        records = [r for r in self.audit.read() if r.get("wave") is None]
        self.settle()
        after = self._totals()

        def delta(name: str) -> int:
            return int(after.get(name, 0) - before.get(name, 0))

        ids = {r.get("request_id") for r in records}
        ours = {
            i
            for i in ids
            if isinstance(i, str) and (i == out.request_id or i.startswith(f"{out.request_id}-"))
        }
        mine = [r for r in records if r.get("request_id") in (ours or ids)]
        external = sum(
            int(r.get("boundary") or 0) - int(r.get("num_computed_tokens") or 0)
            for r in mine
            if r.get("trigger") == "load_verified"
        )
        truncations = sum(1 for r in mine if r.get("trigger") == "load_failed")
        cached = int(out.num_cached_tokens or 0)
        output = [int(t) for t in out.outputs[0].token_ids]
        return RequestResult(
            label=label,
            prompt_tokens=len(tokens),
            cached_tokens=cached,
            local_hit_tokens=cached - external,
            external_hit_tokens=external,
            loaded_bytes=delta("load_bytes"),
            saved_bytes=delta("save_bytes"),
            truncations=truncations,
            failed_keys=delta("load_failed_keys"),
            tokens_match=None if reference is None else output == reference,
            output_tokens=output,
            seconds=round(seconds, 3),
        )

    def close(self) -> None:
        """Settle pending saves, then shut the engine down (the connector flushes and closes its log)."""
        try:
            self.settle()
        finally:
            self._stack.close()
