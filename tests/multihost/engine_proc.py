"""One vLLM engine (CPU, in-process core) with HybridStoreConnector, as its own process on one "host".

``python engine_proc.py SPEC.json``, ``tests/`` on ``PYTHONPATH`` (``support.cluster`` starts it so: the
script imports ``support.engines``). SPEC: ``model``, ``store``, ``namespace``, ``audit_log``, ``out``
(result JSON), ``steps``: a list of ``{"prompt": [token ids], "wait_for": path|null, "done": path|null}``.
Each step waits until ``wait_for`` exists (the test injects a fault, then creates it), sends the prompt,
flushes its saves, drops vLLM's device prefix cache (so the next request must go to the store), records
tokens / cached tokens / seconds / the connector's counters, and creates ``done``.

The result JSON is written after the engine's shutdown; the test checks the exit status.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from support.engines import connectors, engine, generate, reset_local_cache


def _wait_for(path: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    extra = {
        "store": spec["store"],
        "namespace": spec["namespace"],
        "audit_log": spec["audit_log"],
        "lookup_budget_ms": spec.get("lookup_budget_ms", 3000),
    }
    result: dict[str, Any] = {"steps": []}
    t0 = time.monotonic()
    with engine(Path(spec["model"]), extra) as llm:
        result["start_s"] = time.monotonic() - t0
        sched, worker = connectors(llm)
        for step in spec["steps"]:
            if step.get("wait_for"):
                _wait_for(step["wait_for"])
            start = time.monotonic()
            tokens, cached = generate(llm, step["prompt"])
            seconds = time.monotonic() - start
            reset_local_cache(llm)  # flushes this request's saves first
            result["steps"].append(
                {
                    "tokens": tokens,
                    "cached": cached,
                    "seconds": seconds,
                    "sched": dict(sched.scheduler_side.stats.totals),
                    "worker": dict(worker.worker_side.stats.totals),
                    "store": sched.scheduler_side.store.stats().extra,
                }
            )
            if step.get("done"):
                Path(step["done"]).write_text("")
    result["wall_s"] = time.monotonic() - t0
    Path(spec["out"]).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
