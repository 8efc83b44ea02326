"""The whole scheduler bench: every configuration over interleaved rounds (``run_scheduler_bench``)."""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import rotated, spread_text
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR

from hybridkv_dev.bench.scheduler.drive import (
    PeerSpec,
    RunConfig,
    RunSettings,
    drive_config,
    fresh_url,
    request_stream,
)
from hybridkv_dev.bench.scheduler.k3 import K3_BLOCK, K3_DCP, peer_modes
from hybridkv_dev.bench.scheduler.summary import (
    LOOKUP_PROCESS_SUFFIX,
    round_ratios,
    scheduler_targets,
    summarize_config,
)
from hybridkv_dev.bench.scheduler_peer import (
    PEER_CONNECTOR,
)


def run_scheduler_bench(
    store_urls: Sequence[str],
    *,
    labels: dict[str, str] | None = None,
    num_requests: int = 24,
    max_tokens: int = 131072,
    per_step: int = 2,
    num_rounds: int = 5,
    forward_ms: float = 1.0,
    idle_steps: int = 64,
    peer: PeerSpec | None = None,
    lookup_process_urls: Sequence[str] = (),
    models_dir: Path = DEFAULT_MODELS_DIR,
    seed: int = 0,
) -> dict[str, Any]:
    """Per round: one run without the connector, one per store URL and (``peer``) one per lookup mode of
    vLLM's ``MooncakeStoreConnector``, in a rotating order (so a noisy moment hits every configuration alike);
    rows give medians over rounds with their spread, and ratios against the no-connector run of the same
    round (the peer comparison: against the peer's run of the same round). ``forward_ms``: the pause between
    ``schedule()`` calls standing in for the forward pass (short = the connector is asked again most often).
    ``idle_steps``: ``schedule()`` calls after the stream drained (idle steps every configuration has).
    ``labels``: table names for some URLs (e.g. a store behind a delay proxy on a random port).
    ``lookup_process_urls``: store URLs (of ``store_urls``) measured once more with ``lookup_process: true``
    (the row's name ends in ``LOOKUP_PROCESS_SUFFIX``)."""
    assert num_rounds >= 1, "num_rounds must be >= 1"
    assert idle_steps >= 0, "idle_steps must be >= 0"
    names = labels or {}
    stream = request_stream(num_requests, max_tokens, seed)
    prefixes = {fam: random.Random(seed + fam).choice([0.5, 0.75, 1.0]) for fam, _, _ in stream}
    configs = [RunConfig("(no connector)", "none")]
    configs += [RunConfig(names.get(url, url), "hybridkv", url) for url in store_urls]
    configs += [
        RunConfig(names.get(url, url) + LOOKUP_PROCESS_SUFFIX, "hybridkv", url, lookup_process=True)
        for url in lookup_process_urls
    ]
    if peer is not None:
        assert peer.store_url in store_urls, "the peer's like-for-like hybridkv row must be measured"
        configs += [
            RunConfig(f"{PEER_CONNECTOR} {mode} ({peer.where})", "peer", None, lookup_async, prefetch)
            for mode, lookup_async, prefetch in peer_modes()
        ]
    settings = RunSettings(stream, prefixes, models_dir, per_step, forward_ms / 1e3, idle_steps)
    by_config: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(configs))}
    for round_index in range(num_rounds):
        for i in rotated(range(len(configs)), round_index):
            config = configs[i]
            if config.url is not None and round_index > 0:
                # every round starts from an empty store of the same kind
                config = dataclasses.replace(config, url=fresh_url(config.url))
            by_config[i].append(drive_config(config, settings, peer.server if peer is not None else None))
    base = by_config[0]
    rows = [summarize_config(c.label, by_config[i], None if i == 0 else base) for i, c in enumerate(configs)]
    if peer is not None:
        for ours in (i for i, c in enumerate(configs) if c.kind == "hybridkv" and c.url == peer.store_url):
            first_peer = len(configs) - len(peer_modes())
            for index, (mode, _, _) in enumerate(peer_modes(), start=first_peer):
                ratios = round_ratios(by_config[ours], by_config[index], "connector_p99_ms")
                if ratios:
                    rows[ours][f"connector_p99_over_peer_{mode}"] = statistics.median(ratios)
                    rows[ours][f"connector_p99_over_peer_{mode}_spread"] = spread_text(ratios)
    return {
        "targets": scheduler_targets(rows),
        "benchmark": "scheduler",
        "geometry": f"MLA block {K3_BLOCK} x DCP {K3_DCP} + Mamba align block {K3_BLOCK}, hash unit {K3_BLOCK}",
        "num_requests": num_requests,
        "max_prompt_tokens": max_tokens,
        "requests_per_step": per_step,
        "num_rounds": num_rounds,
        "forward_ms": forward_ms,
        "idle_steps": idle_steps,
        "peer": None
        if peer is None
        else {
            "connector": PEER_CONNECTOR,
            "modes": {
                mode: {"lookup_async": lookup_async, "lookup_prefetch_limit": prefetch}
                for mode, lookup_async, prefetch in peer_modes()
            },
            "geometry": "the same (it accepts MLA + Mamba align with DCP 8)",
            "master_address": peer.server.master_address,
            "like_for_like_row": names.get(peer.store_url, peer.store_url),
            "key_prefixes": peer.server.info.get("key_prefixes"),
            "worker_log": str(peer.server.log_path),
        },
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
        "rounds": {c.label: by_config[i] for i, c in enumerate(configs)},
    }
