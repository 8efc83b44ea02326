"""``hybridkv bench scheduler --inflight``: ``may_load_async`` at vLLM 0.34's real ``Scheduler`` (0.34 only).

vLLM 0.34's ``--max-num-inflight-kv-loads`` lets a request the connector ``may_load_async`` wait in a queue
of its own and start its asynchronous load while the running batch is full, up to the cap; with vLLM's default
answer (False for anything but a P/D remote prefill) a hit's load starts only once a running slot is free,
and the hit then waits for its load before it runs.

The run: the devkit's ``Cluster`` (vLLM's real ``Scheduler`` with hybridkv's scheduler half, and one worker
half per TP rank over one store, every loaded slot checked against a recompute) at MLA + Mamba align with
TP 2 x DCP 2, ``max_num_seqs`` = ``batch`` and ``max_num_inflight_kv_loads`` set. A closed loop of ``batch``
background requests (each decodes ``decode_steps`` tokens; one that finishes is replaced at once by a new
one, which misses the store) keeps the running batch full; hit requests (prompts a cold run saved) arrive
every ``hit_every`` steps. Every load takes ``load_steps`` engine steps: the bench hands a planned load job
to the workers ``load_steps - 1`` steps after the scheduler planned it (the scheduler holds the request in
``WAITING_FOR_REMOTE_KVS`` meanwhile), as a transfer that long would. Per hit request: the steps from its
arrival to its first scheduled token (the step that schedules its first tokens; 0 = the step it arrived in),
and to its load's start.

Two arms on the same stream, run alternately in interleaved rounds (each run on a store of its own, filled
by the same cold run): ``may_load_async on`` (the connector's hook) and ``may_load_async off`` (vLLM's base
class answer, ``KVConnectorBase_V1.may_load_async``). Rows give medians over rounds of each run's median,
with the spread (min..max over rounds).
"""

from __future__ import annotations

import statistics
import types
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.bench.report import spread_text

__all__ = ["INFLIGHT_COLUMNS", "InflightSettings", "inflight_unavailable_reason", "run_inflight_bench"]

#: the table columns of the ``may_load_async`` axis
INFLIGHT_COLUMNS = [
    "arm",
    "num_rounds",
    "hits",
    "hits_loaded",
    "first_token_steps_p50",
    "first_token_steps_p50_spread",
    "first_token_steps_max",
    "load_start_steps_p50",
    "loads_started_batch_full",
    "background_first_token_steps_p50",
    "num_steps",
]

ARM_ON = "may_load_async on"
ARM_OFF = "may_load_async off"
_GEOMETRY = "mla_mamba"
_TP = 2
_DCP = 2
_MAX_STEPS = 2000


@dataclass(frozen=True)
class InflightSettings:
    """The stream and the engine limits of one run."""

    batch: int = 4
    """``max_num_seqs``: the running batch"""
    inflight_loads: int = 2
    """``max_num_inflight_kv_loads``"""
    load_steps: int = 4
    """engine steps a load takes"""
    num_hits: int = 8
    hit_every: int = 4
    """a hit request arrives every this many steps"""
    decode_steps: int = 16
    """output tokens of a background request"""
    prompt_tokens: int = 256


def inflight_unavailable_reason() -> str | None:
    """Why the axis cannot run with the installed vLLM (``None`` when it can): the hook and the flag came
    with vLLM 0.34."""
    from hybridkv.connector.vllm_compat import vllm_release

    release = vllm_release()
    if release < (0, 34):
        return f"vLLM {release[0]}.{release[1]} has no may_load_async and --max-num-inflight-kv-loads"
    return None


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 30000) for _ in range(n)]


def _hit_prompts(settings: InflightSettings, seed: int) -> list[list[int]]:
    return [_prompt(seed * 1000 + i, settings.prompt_tokens) for i in range(settings.num_hits)]


def _fill_store(store_url: str, prompts: Sequence[list[int]]) -> None:
    """A cold run over ``store_url`` that saves every prompt (what a previous request saved)."""
    from hybridkv_dev.devkit.cluster import Cluster, hybrid_config

    vc, kvc = hybrid_config(_GEOMETRY, dcp=_DCP, tp=_TP, store=store_url)
    cold = Cluster(vc, kvc)
    try:
        for i, prompt in enumerate(prompts):
            cold.add(f"cold-{i}", prompt)
        cold.run()
    finally:
        cold.shutdown()


class _Run:
    """One run of one arm over a started ``Cluster``: the stream, the held loads, and per request its arrival,
    load start and first scheduled token (engine step numbers)."""

    def __init__(self, cl: Any, settings: InflightSettings, hits: Sequence[list[int]], seed: int) -> None:
        self.cl = cl
        self.settings = settings
        self.hits = hits
        self.hit_ids = [f"hit{i}" for i in range(len(hits))]
        self.seed = seed
        self.arrived: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.load_start: dict[str, int] = {}
        self.full_at_load: dict[str, bool] = {}
        self.held: list[tuple[int, Any]] = []  # (step the workers get the job, load job)
        self.background: set[str] = set()
        self.num_background = 0
        self.next_hit = 0
        self.running_at_schedule = 0

    def add_background(self) -> None:
        k = self.num_background
        rid = f"bg{k}"
        # The first batch finishes staggered, so that a slot frees every few steps.
        stagger = self.settings.decode_steps * (k + 1) // self.settings.batch
        max_tokens = stagger if k < self.settings.batch else self.settings.decode_steps
        self.cl.add(rid, _prompt(10**6 + self.seed * 1000 + k, self.settings.prompt_tokens), max_tokens)
        self.arrived[rid] = self.cl.steps + 1
        self.background.add(rid)
        self.num_background += 1

    def hold_loads(self, out: Any) -> None:
        """``Cluster.step``'s ``before_load``: the load jobs the scheduler planned this step go to the workers
        ``load_steps - 1`` steps later (the workers then finish them within that step)."""
        meta = out.kv_connector_metadata
        now = self.cl.steps
        full = self.running_at_schedule >= self.settings.batch
        for job in meta.loads:
            self.load_start[job.req_id] = now
            self.full_at_load[job.req_id] = full
            self.held.append((now + self.settings.load_steps - 1, job))
        meta.loads = [job for due, job in self.held if due <= now]
        self.held = [(due, job) for due, job in self.held if due > now]

    def step(self) -> None:
        cl = self.cl
        self.running_at_schedule = len(cl.sched.running)  # the batch as schedule() finds it
        out = cl.step(before_load=self.hold_loads)
        for rid in out.num_scheduled_tokens:
            self.first_token.setdefault(rid, cl.steps)
        hits_pending = self.next_hit < len(self.hits) or any(r in cl.sched.requests for r in self.hit_ids)
        for rid in [r for r in self.background if r not in cl.sched.requests]:
            self.background.discard(rid)
            if hits_pending:
                self.add_background()  # the closed loop, while hits are still coming or running
        assert cl.steps < _MAX_STEPS, "the stream did not drain"

    def serve(self) -> None:
        cl, settings = self.cl, self.settings
        for _ in range(settings.batch):
            self.add_background()
        # The batch is full and decoding before the first hit arrives.
        while len(cl.sched.running) < settings.batch or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in cl.sched.running
        ):
            self.step()
        first_hit_step = cl.steps + 1
        while cl.sched.requests or self.held or self.next_hit < len(self.hits):
            i = self.next_hit
            if i < len(self.hits) and cl.steps + 1 >= first_hit_step + i * settings.hit_every:
                cl.add(self.hit_ids[i], self.hits[i], max_tokens=2)
                self.arrived[self.hit_ids[i]] = cl.steps + 1
                self.next_hit += 1
            self.step()
        cl.run()  # the saves still in flight

    def result(self, arm: str) -> dict[str, Any]:
        def since_arrival(at: dict[str, int], rid: str) -> int | None:
            return at[rid] - self.arrived[rid] if rid in at else None

        return {
            "arm": arm,
            "num_steps": self.cl.steps,
            "hits": [
                {
                    "request": rid,
                    "first_token_steps": since_arrival(self.first_token, rid),
                    "load_start_steps": since_arrival(self.load_start, rid),
                    "load_started_batch_full": self.full_at_load.get(rid, False),
                    "loaded_tokens": self.cl.loads_checked.get(rid, 0),
                }
                for rid in self.hit_ids
            ],
            "background_first_token_steps": [
                since_arrival(self.first_token, rid) for rid in self.arrived if rid.startswith("bg")
            ],
        }


def _run_arm(on: bool, settings: InflightSettings, seed: int) -> dict[str, Any]:
    """One run of one arm on a store of its own, filled by a cold run of the hit prompts."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from hybridkv_dev.devkit.cluster import Cluster, hybrid_config

    store_url = f"memory://bench-inflight-{uuid.uuid4().hex[:8]}"
    hits = _hit_prompts(settings, seed)
    _fill_store(store_url, hits)
    vc, kvc = hybrid_config(_GEOMETRY, dcp=_DCP, tp=_TP, store=store_url)
    vc.scheduler_config.max_num_seqs = settings.batch
    vc.scheduler_config.max_num_inflight_kv_loads = settings.inflight_loads
    cl = Cluster(vc, kvc)
    try:
        if not on:  # vLLM's own answer: False for anything but a P/D remote prefill
            connector: Any = cl.sched.connector
            base: Any = KVConnectorBase_V1  # typed against the oldest supported vLLM, which has no hook
            connector.may_load_async = types.MethodType(base.may_load_async, connector)
        run = _Run(cl, settings, hits, seed)
        run.serve()
        return run.result(ARM_ON if on else ARM_OFF)
    finally:
        cl.shutdown()


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _summarize(arm: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row: medians over rounds of each run's median, their spread, and totals over every run."""
    medians = [_median([h["first_token_steps"] for h in run["hits"]]) for run in runs]
    starts = [
        _median(starts)
        for run in runs
        for starts in [[h["load_start_steps"] for h in run["hits"] if h["load_start_steps"] is not None]]
        if starts
    ]
    return {
        "arm": arm,
        "num_rounds": len(runs),
        "hits": sum(len(run["hits"]) for run in runs),
        "hits_loaded": sum(1 for run in runs for h in run["hits"] if h["loaded_tokens"] > 0),
        "first_token_steps_p50": _median(medians),
        "first_token_steps_p50_spread": spread_text(medians, "g"),
        "first_token_steps_max": max(h["first_token_steps"] for run in runs for h in run["hits"]),
        "load_start_steps_p50": _median(starts) if starts else None,
        "loads_started_batch_full": sum(
            1 for run in runs for h in run["hits"] if h["load_started_batch_full"]
        ),
        "background_first_token_steps_p50": _median(
            [_median(run["background_first_token_steps"]) for run in runs]
        ),
        "num_steps": _median([run["num_steps"] for run in runs]),
    }


def run_inflight_bench(
    settings: InflightSettings = InflightSettings(), *, num_rounds: int = 5, seed: int = 0
) -> dict[str, Any]:
    """Per round one run of each arm, in alternating order, on the same stream. ``steps_saved``: per round,
    the off arm's median first-token steps minus the on arm's; its median and spread."""
    reason = inflight_unavailable_reason()
    assert reason is None, reason
    assert num_rounds >= 1, "num_rounds must be >= 1"
    runs: dict[str, list[dict[str, Any]]] = {ARM_ON: [], ARM_OFF: []}
    for round_index in range(num_rounds):
        for on in (True, False) if round_index % 2 == 0 else (False, True):
            run = _run_arm(on, settings, seed)
            runs[run["arm"]].append(run)
    rows = [_summarize(arm, arm_runs) for arm, arm_runs in runs.items()]
    saved = [
        _median([h["first_token_steps"] for h in off["hits"]])
        - _median([h["first_token_steps"] for h in on["hits"]])
        for on, off in zip(runs[ARM_ON], runs[ARM_OFF], strict=True)
    ]
    return {
        "benchmark": "scheduler-inflight",
        "geometry": f"{_GEOMETRY}: MLA + Mamba align, TP {_TP} x DCP {_DCP} (devkit Cluster, real workers)",
        "settings": {
            "max_num_seqs": settings.batch,
            "max_num_inflight_kv_loads": settings.inflight_loads,
            "load_steps": settings.load_steps,
            "num_hits": settings.num_hits,
            "hit_every_steps": settings.hit_every,
            "background_decode_steps": settings.decode_steps,
            "prompt_tokens": settings.prompt_tokens,
        },
        "num_rounds": num_rounds,
        "steps_saved_p50": _median(saved),
        "steps_saved_spread": spread_text(saved, "g"),
        "rows": rows,
        "runs": runs,
    }
