"""Divergent local hits on real engines, with the connector's ``divergent_local_hits`` off and on (``hybridkv
bench divergent``), as pure functions returning dicts.

The scenario is a conversation that branched: X = P + Q was served and stored (by this engine or another one
sharing the store); then the local cache served P + R, a branch leaving X after P (an edited turn, a
sub-agent's fork). Now X comes back. vLLM's local cache holds P's full-attention pages, but a recurrent
model's state only at P + R's end. With the switch off vLLM reports the boundary every group agrees on --
0 here -- and the store serves X's whole prefix; with it on vLLM keeps P's pages and the store serves only
the rest plus the state at X's boundary. Both resume at the same boundary, so they compute the same tokens:
what the switch saves is the load (tokens and bytes moved from the store, and the time to first token
they cost). In the second scenario (``head evicted``) the store has lost P's attention blocks meanwhile (an
LRU store evicts a prefix's head first: it is the oldest use): with the switch off nothing past 0 can be
restored and X is computed whole; with it on P's resident pages and the store's rest still make the hit.

Per configuration one in-process engine (a tiny random-weight model of ``family``) runs ``num_scenarios``
scenarios with fresh tokens each; rounds alternate which configuration runs first. Reported per
configuration and scenario kind: for the returning X, the local and external hit tokens, the tokens it
computes, the load's bytes, its time to first token (one greedy token, wall clock), medians with [min, max]
over every scenario of every round; ratios (on / off, same scenario kind) are taken per round, then their
median and spread; and whether X's tokens equal its cold run's in every scenario (they must).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.report import target_row
from hybridkv.demo import vllm_harness
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.ops import inprocess

__all__ = ["CONFIGURATIONS", "DIVERGENT_COLUMNS", "run_divergent_bench"]

#: configuration name -> the ``divergent_local_hits`` switch
CONFIGURATIONS: dict[str, bool] = {"switch off": False, "switch on": True}
#: scenario name -> whether the store loses P's attention blocks before X returns
SCENARIOS: dict[str, bool] = {"branch": False, "branch, head evicted": True}

DIVERGENT_COLUMNS = [
    "scenario",
    "configuration",
    "local_tokens",
    "external_tokens",
    "computed_tokens",
    "loaded_mib",
    "ttft_ms",
    "ttft_ms_spread",
    "loaded_ratio",
    "ttft_ratio",
    "ttft_ratio_spread",
    "identical",
]


def _prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(num_tokens)]


def _spread(values: Sequence[float]) -> str:
    return f"[{min(values):.3g}, {max(values):.3g}]"


def _evict_head(scheduler_half: Any, tokens: list[int], num_blocks: int) -> None:
    """Remove the attention entries of ``tokens``' first ``num_blocks`` blocks from the engine's store."""
    from hybridkv.lifecycle.kinds import GroupKind

    side = scheduler_half.scheduler_side
    scheme = side.scheme
    geometry = scheme.geometry
    hashes = vllm_harness.block_hashed_request("evict", tokens, geometry.hash_unit).block_hashes
    keys = [
        scheme.key(g, rank.tp_rank, scheme.boundary_hash(hashes, (i + 1) * span))
        for g, (group, span) in enumerate(zip(geometry.groups, geometry.spans, strict=True))
        if group.kind is GroupKind.FULL
        for i in range(num_blocks)
        for rank in geometry.topology.ranks
    ]
    statuses = side.store.remove(keys)
    assert all(status.is_ok for status in statuses), f"evicting X's head: {statuses}"


def _scenario(
    llm: Any, scheduler_half: Any, worker_stats: Any, seed: int, block: int, *, evict_head: bool
) -> dict[str, Any]:
    """One branched conversation on ``llm``: X cold (stored), the local cache dropped, P + R served, X again
    (``evict_head``: then P's attention entries are removed from the store). The figures of X's return (hit
    tokens are the scheduler's count, loaded bytes the worker's)."""
    scheduler_stats = scheduler_half.scheduler_side.stats

    def hit_tokens() -> int:
        return int(scheduler_stats.totals.get("hit_tokens", 0))

    def loaded_bytes() -> int:
        return int(worker_stats.totals.get("load_bytes", 0))

    p = _prompt(2 * block + 4, seed)
    q = _prompt(2 * block + 44, seed + 1)
    r = _prompt(2 * block + 44, seed + 2)
    x = p + q
    cold = list(vllm_harness.greedy(llm, x, 1).outputs[0].token_ids)
    vllm_harness.settle(llm)
    vllm_harness.drop_local_cache(llm)
    vllm_harness.greedy(llm, p + r, 1)
    vllm_harness.settle(llm)
    if evict_head:  # after P + R, whose save stored P's blocks again
        _evict_head(scheduler_half, x, len(p) // block)
    before_hits, before_bytes = hit_tokens(), loaded_bytes()
    started = time.perf_counter()
    out = vllm_harness.greedy(llm, x, 1)
    ttft_s = time.perf_counter() - started
    num_cached = int(out.num_cached_tokens or 0)
    num_external = hit_tokens() - before_hits
    vllm_harness.settle(llm)
    return {
        "local_tokens": num_cached - num_external,
        "external_tokens": num_external,
        "computed_tokens": len(x) - num_cached,
        "loaded_bytes": loaded_bytes() - before_bytes,
        "ttft_s": ttft_s,
        "identical": list(out.outputs[0].token_ids) == cold,
    }


def _run_configuration(
    model_dir: Path, store_dir: Path, switch: bool, seeds: Sequence[int], block: int
) -> list[dict[str, Any]]:
    extra = {"store": f"file://{store_dir}?capacity=1GiB", "divergent_local_hits": switch}
    transfer = inprocess.connector_transfer_config(extra)
    with inprocess.inprocess_engine(model_dir, transfer) as llm:
        scheduler_half, worker_half = inprocess.connector_halves(llm)
        worker_stats = worker_half.worker_side.stats
        return [
            {
                "scenario": scenario,
                **_scenario(llm, scheduler_half, worker_stats, seed, block, evict_head=evict_head),
            }
            for scenario, evict_head in SCENARIOS.items()
            for seed in seeds
        ]


def _row(
    scenario: str,
    name: str,
    runs: Sequence[dict[str, Any]],
    rounds: Sequence[dict[str, dict[str, float]]],
    baseline: str,
) -> dict[str, Any]:
    """The table row of one (scenario, configuration): medians over its returns; ratios to ``baseline``
    (same scenario) per round, then their median."""
    ttfts_ms = [1e3 * run["ttft_s"] for run in runs]
    row: dict[str, Any] = {
        "scenario": scenario,
        "configuration": name,
        "local_tokens": statistics.median(run["local_tokens"] for run in runs),
        "external_tokens": statistics.median(run["external_tokens"] for run in runs),
        "computed_tokens": statistics.median(run["computed_tokens"] for run in runs),
        "loaded_mib": round(statistics.median(run["loaded_bytes"] for run in runs) / 2**20, 3),
        "ttft_ms": round(statistics.median(ttfts_ms), 2),
        "ttft_ms_spread": _spread(ttfts_ms),
        "identical": f"{sum(run['identical'] for run in runs)}/{len(runs)}",
    }
    if name != baseline:
        mine, theirs = f"{scenario} / {name}", f"{scenario} / {baseline}"
        loaded = [
            r[mine]["loaded_bytes"] / r[theirs]["loaded_bytes"] for r in rounds if r[theirs]["loaded_bytes"]
        ]
        ttft = [r[mine]["ttft_s"] / r[theirs]["ttft_s"] for r in rounds]
        row["loaded_ratio"] = round(statistics.median(loaded), 3) if loaded else None
        row["ttft_ratio"] = round(statistics.median(ttft), 3)
        row["ttft_ratio_spread"] = _spread(ttft)
    return row


def run_divergent_bench(
    *,
    family: str = "qwen3_next",
    num_rounds: int = 3,
    num_scenarios: int = 4,
    models_dir: Path = DEFAULT_MODELS_DIR,
    scratch_dir: str | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Run the bench (see the module docstring); the report dict (``rows``, ``rounds``, ``targets``, setup)."""
    assert num_rounds >= 1 and num_scenarios >= 1, f"rounds {num_rounds}, scenarios {num_scenarios}"
    inprocess.prepare_inprocess_environment(quiet=True)
    model_dir = build_tiny_model(family, models_dir)
    block = 128  # the tiny families' block (full attention and state alike)
    names = list(CONFIGURATIONS)
    cell_to_runs: dict[tuple[str, str], list[dict[str, Any]]] = {
        (scenario, name): [] for scenario in SCENARIOS for name in names
    }
    #: per round, per (scenario, configuration): the medians the ratios are taken from
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="hybridkv-divergent-", dir=scratch_dir) as scratch:
        for round_index in range(num_rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            seeds = [1000 * round_index + 10 * k for k in range(num_scenarios)]
            per_round: dict[str, dict[str, float]] = {}
            for name in order:
                store_dir = Path(scratch) / f"r{round_index}-{names.index(name)}"
                runs = _run_configuration(model_dir, store_dir, CONFIGURATIONS[name], seeds, block)
                for scenario in SCENARIOS:
                    mine = [run for run in runs if run["scenario"] == scenario]
                    cell_to_runs[scenario, name].extend(mine)
                    per_round[f"{scenario} / {name}"] = {
                        "loaded_bytes": statistics.median(run["loaded_bytes"] for run in mine),
                        "ttft_s": statistics.median(run["ttft_s"] for run in mine),
                        "computed_tokens": statistics.median(run["computed_tokens"] for run in mine),
                    }
                progress(f"round {round_index + 1}/{num_rounds} {name}: {len(runs)} returns")
            rounds.append(per_round)
    rows = [
        _row(scenario, name, cell_to_runs[scenario, name], rounds, names[0])
        for scenario in SCENARIOS
        for name in names
    ]
    num_returns = sum(len(runs) for runs in cell_to_runs.values())

    def cell(scenario: str, name: str) -> dict[str, Any]:
        return next(row for row in rows if row["scenario"] == scenario and row["configuration"] == name)

    branch_on, evicted_on, evicted_off = (
        cell("branch", "switch on"),
        cell("branch, head evicted", "switch on"),
        cell("branch, head evicted", "switch off"),
    )
    targets = [
        target_row(
            "X's tokens identical to its cold run, every scenario and configuration",
            sum(int(row["identical"].split("/")[0]) for row in rows),
            "==",
            num_returns,
        ),
        target_row("branch, switch on: local tokens kept (median)", branch_on["local_tokens"], ">=", block),
        target_row("branch, switch on: loaded bytes vs off (ratio)", branch_on["loaded_ratio"], "<=", 0.9),
        target_row(
            "head evicted, switch on: tokens computed vs off (ratio)",
            evicted_on["computed_tokens"] / max(1, evicted_off["computed_tokens"]),
            "<=",
            0.5,
        ),
    ]
    return {
        "family": family,
        "num_rounds": num_rounds,
        "num_scenarios": num_scenarios,
        "block": block,
        "rows": rows,
        "rounds": rounds,
        "targets": targets,
    }
