"""The whole ttft bench: every family, every connector, the host's load around each (``run_ttft_bench``)."""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridkv.bench.harness import load_average, load_change
from hybridkv.bench.store import measure_memcpy
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.ops import inprocess

from hybridkv_dev.bench.ttft.connectors import (
    measure_example_connector,
    measure_hybridkv,
    measure_mooncake_store_connector,
    num_torch_threads,
)
from hybridkv_dev.bench.ttft.engine import (
    DEFAULT_FAMILIES,
    EXAMPLE_FAMILIES,
    cpu_has_fast_bf16,
    measure_store_path,
    model_facts,
    num_params,
    resolve_dtype,
    started_mooncake_master,
)
from hybridkv_dev.bench.ttft.rows import (
    PEER_CONNECTOR,
    PROFILE_SOURCES,
    _row,
    hit_profile,
    median_if_any,
    ratio_or_none,
    ttft_targets,
)


def run_ttft_bench(
    families: Sequence[str] = DEFAULT_FAMILIES,
    *,
    scratch_dir: str | os.PathLike[str],
    prompt_tokens: int = 4000,
    rounds: int = 3,
    size: str = "bench",
    dtype: str = "auto",
    baseline: bool = True,
    mooncake: bool = False,
    models_dir: Path = DEFAULT_MODELS_DIR,
    kv_cache_bytes: int | None = None,
    reserved_cpus: int = 1,
    keyed: bool = False,
) -> dict[str, Any]:
    """Measure every family; one row per (family, connector) with medians and same-run ratios.

    ``keyed``: also hybridkv on a ``file://`` store in keyed-integrity mode (``integrity_key_file``, a fresh
    secret in the scratch directory; ``hybridkv.store.integrity``), to price the mode next to the plain row.

    Every engine (the in-process ones and ``MooncakeStoreConnector``'s child) computes on this process's
    cores with ``max(1, cores - reserved_cpus)`` torch threads, like ``bench serve``'s ``--reserved-cpus``:
    the reserved core is left to the connectors' own threads and to other jobs on a shared host, where
    an OpenMP barrier across every core stalls whenever another process takes one of them.

    ``mooncake``: also hybridkv on ``mooncake://`` and vLLM's ``MooncakeStoreConnector`` (own process),
    against a ``mooncake_master`` the bench starts; needs a loopback-only network namespace
    (``scripts/netns-run``), else ``RuntimeError``."""
    # One process, so the connector's worker half is reachable; vLLM logs to stdout: keep the table readable.
    inprocess.prepare_inprocess_environment("ERROR")
    if rounds < 1 or prompt_tokens < 1:
        raise ValueError("need rounds >= 1 and prompt_tokens >= 1")
    resolved_dtype = resolve_dtype(dtype)
    compute_threads = _set_compute_threads(reserved_cpus)
    scratch = Path(scratch_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        master = (
            stack.enter_context(started_mooncake_master(scratch / "mooncake")).address if mooncake else None
        )
        rows, details, profiles, not_measured = _measure_families(
            families,
            scratch=scratch,
            master_address=master,
            prompt_tokens=prompt_tokens,
            rounds=rounds,
            size=size,
            dtype=resolved_dtype,
            baseline=baseline,
            models_dir=models_dir,
            kv_cache_bytes=kv_cache_bytes,
            keyed=keyed,
        )
    if not mooncake:
        not_measured.append("Mooncake rows: not run (pass --mooncake, under scripts/netns-run)")
    return {
        "benchmark": "ttft",
        "unit": "ms of wall time of llm.generate(max_tokens=1) for one request; medians over rounds",
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "size": size,
        "dtype": resolved_dtype,
        "dtype_requested": dtype,
        "cpu_fast_bf16": cpu_has_fast_bf16(),
        "reserved_cpus": reserved_cpus,
        "compute_threads": compute_threads,
        "protocol": "per round a fresh prompt: cold; the same prompt again (local hit); reset_prefix_cache() "
        "(keeps the store) then the same prompt (external hit). Saves are flushed between requests, untimed. "
        "One warm-up round on a short prompt is not counted. MooncakeStoreConnector runs the same protocol "
        "in its own spawned process (its in-process teardown hangs), against the same mooncake_master, on "
        "the same cores with the same torch threads; after its cold request the engine steps until no KV "
        "block is referenced (its save finished), so its local hit runs with no store traffic beside it.",
        "ratios": "overhead_ms = median over rounds of (external-hit - local-hit) of the same engine; "
        "copy_floor_ms = loaded bytes / memcpy GB/s of the same value size, measured in this process; "
        "overhead_over_floor = overhead / copy floor; overhead_over_peer = overhead / the same family's "
        "MooncakeStoreConnector overhead; *_spread = [min, max] over rounds. ExampleConnector runs with "
        "prefix caching off (its loaded_bytes = safetensors bytes it wrote), so its overhead uses the "
        "file-store engine's local hits.",
        "rows": rows,
        "targets": ttft_targets(rows),
        "profiles": profiles,
        "profile_sources": PROFILE_SOURCES,
        "details": details,
        "not_measured": not_measured,
        "seconds": time.perf_counter() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def _set_compute_threads(reserved_cpus: int) -> int:
    """Give this process's engines ``max(1, cores - reserved_cpus)`` torch threads (the peer child copies
    this process's count); returns the count in effect. vLLM's CPU worker disables
    ``torch.set_num_threads`` once an engine has started in this process: the count then stays what it was
    (the report records it)."""
    import torch

    if reserved_cpus < 0:
        raise ValueError(f"reserved_cpus must be >= 0, got {reserved_cpus}")
    wanted = max(1, len(os.sched_getaffinity(0)) - reserved_cpus)
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return num_torch_threads()


#: The row of ``keyed``: the file store in keyed-integrity mode.
KEYED_LABEL = "HybridStoreConnector file:// keyed"


def _integrity_key_file(scratch: Path) -> Path:
    """A key file with one fresh secret, readable by its owner only (the store warns otherwise)."""
    path = scratch / "integrity.key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def _hybridkv_stores(
    family: str, scratch: Path, capacity: int, master_address: str | None, *, keyed: bool
) -> list[tuple[str, str]]:
    """(row label, store URL) of each hybridkv row of ``family``: the file store, keyed too with ``keyed``,
    and Mooncake with a master."""
    stores = [("HybridStoreConnector file://", f"file://{scratch}/store-{family}?capacity={capacity}")]
    if keyed:
        key_file = _integrity_key_file(scratch)
        stores.append(
            (
                KEYED_LABEL,
                f"file://{scratch}/store-{family}-keyed?capacity={capacity}&integrity_key_file={key_file}",
            )
        )
    if master_address is not None:
        stores.append(
            (
                "HybridStoreConnector mooncake://",
                f"mooncake://{master_address}?segment={capacity}&local_buffer=16MiB",
            )
        )
    return stores


def _measure_families(
    families: Sequence[str],
    *,
    scratch: Path,
    master_address: str | None,
    prompt_tokens: int,
    rounds: int,
    size: str,
    dtype: str,
    baseline: bool,
    models_dir: Path,
    kv_cache_bytes: int | None,
    keyed: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    profiles: list[dict[str, Any]] = []
    not_measured: list[str] = []
    for family in families:
        model_dir = build_tiny_model(family, models_dir, size=size)
        facts = model_facts(family, size, dtype)
        per_prompt = prompt_tokens * max(1, facts["kv_bytes_per_token_full_attention"])
        # Room for a few prompts in vLLM's cache (hybrids: the state groups take as much again).
        kv_bytes = kv_cache_bytes or max(64 << 20, 6 * per_prompt)
        capacity = max(256 << 20, 4 * (rounds + 1) * per_prompt)
        stores = _hybridkv_stores(family, scratch, capacity, master_address, keyed=keyed)
        family_rows: list[dict[str, Any]] = []
        memcpy_gbps: float | None = None
        first_local: list[float] = []
        for label, url in stores:
            audit = scratch / f"audit-{family}-{len(family_rows)}.jsonl"
            load_at_start = load_average()
            ours = measure_hybridkv(
                model_dir,
                store_url=url,
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
                audit_log=audit,
            )
            med_bytes = int(statistics.median(ours["loaded_bytes"]))
            med_keys = int(statistics.median(ours["loaded_keys"]))
            store_path = None
            if med_bytes > 0 and med_keys > 0:
                value_size = max(1, med_bytes // med_keys)
                # The same bytes in the same value size as the load, measured now (same machine load).
                gbps = measure_memcpy(value_size, med_keys, repeats=5)["memcpy_gbps"]
                memcpy_gbps = memcpy_gbps or gbps
                path_url = url.replace(f"store-{family}", f"store-{family}-microbench")
                store_path = measure_store_path(path_url, value_size, med_keys)
            row = _row(
                family,
                label,
                samples_s=ours["samples_s"],
                ext_tokens=int(statistics.median(ours["num_cached_tokens"]["external"])),
                loaded_bytes=med_bytes,
                loaded_keys=med_keys,
                memcpy_gbps=memcpy_gbps,
                load_job=median_if_any(ours["load_job_s"]),
            ) | {"loadavg_1m": load_change(load_at_start)}
            family_rows.append(row)
            first_local = first_local or ours["samples_s"]["local"]
            profiles.append(
                {"family": family, "connector": label}
                | hit_profile(
                    row["overhead_ms"],
                    ours["load_profile"],
                    store_path,
                    median_if_any(ours["load_job_s"]),
                    ours["load_phases_ms"],
                )
            )
            details[f"{family}/{label}"] = {
                "model": str(model_dir),
                "model_facts": facts,
                "params": num_params(model_dir),
                "kv_cache_memory_bytes": kv_bytes,
                "store_path": store_path,
                **ours,
            }
        peer_ok = master_address is not None and family in EXAMPLE_FAMILIES
        if master_address is not None and not peer_ok:
            not_measured.append(
                f"{family}: MooncakeStoreConnector not run (hybrids need mamba_cache_mode=align there)"
            )
        if peer_ok:
            assert master_address is not None
            load_at_start = load_average()
            peer = measure_mooncake_store_connector(
                model_dir,
                master_address=master_address,
                segment_bytes=capacity,
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
                work_dir=scratch / f"peer-{family}",
            )
            details[f"{family}/{PEER_CONNECTOR}"] = peer
            if "error" in peer:
                not_measured.append(f"{family}: {PEER_CONNECTOR} failed: {peer['error']}")
            else:
                tokens = int(statistics.median(peer["num_cached_tokens"]["external"]))
                family_rows.append(
                    _row(
                        family,
                        PEER_CONNECTOR,
                        samples_s=peer["samples_s"],
                        ext_tokens=tokens,
                        loaded_bytes=tokens * facts["kv_bytes_per_token_full_attention"],
                        loaded_keys=None,
                        memcpy_gbps=memcpy_gbps,
                    )
                    | {"loadavg_1m": load_change(load_at_start)}
                )
        if baseline and family in EXAMPLE_FAMILIES:
            load_at_start = load_average()
            example = measure_example_connector(
                model_dir,
                storage_dir=scratch / f"example-{family}",
                prompt_tokens=prompt_tokens,
                rounds=rounds,
                kv_cache_bytes=kv_bytes,
                dtype=dtype,
            )
            family_rows.append(
                _row(
                    family,
                    "ExampleConnector (vLLM)",
                    samples_s=example["samples_s"],
                    local_s=first_local,  # prefix caching off there: the file-store engine's local hits
                    ext_tokens=int(statistics.median(example["num_cached_tokens"]["external"])),
                    loaded_bytes=int(statistics.median(example["file_bytes"])),
                    loaded_keys=None,
                    memcpy_gbps=memcpy_gbps,
                )
                | {"local_hit_ms": None, "loadavg_1m": load_change(load_at_start)}
            )
            details[f"{family}/ExampleConnector"] = example
        elif baseline:
            not_measured.append(
                f"{family}: no ExampleConnector baseline (it does not support the hybrid KV-cache manager)"
            )
        peer_row = next((row for row in family_rows if row["connector"] == PEER_CONNECTOR), None)
        peer_overhead = peer_row["overhead_ms"] if peer_row is not None else None
        if peer_row is not None and (peer_overhead is None or peer_overhead <= 0):
            # Noise larger than the hit: a ratio over it would mean nothing.
            not_measured.append(
                f"{family}: overhead_over_peer not computable: {PEER_CONNECTOR}'s overhead is "
                f"{format(peer_overhead, '.1f') if peer_overhead is not None else 'unknown'} ms "
                f"(external hit {peer_row['external_hit_ms']:.1f} ms, local hit {peer_row['local_hit_ms']:.1f} "
                f"ms, spread {peer_row['overhead_ms_spread']})"
            )
        for row in family_rows:
            if peer_overhead is not None and peer_overhead > 0:
                row["overhead_over_peer"] = ratio_or_none(row["overhead_ms"], peer_overhead)
        rows.extend(family_rows)
    return rows, details, profiles, not_measured
