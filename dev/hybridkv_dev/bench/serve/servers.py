"""One server per configuration: its shape (local KV cache, store capacity, cores) and its start."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.store.params import parse_size

from hybridkv_dev.bench.serve.workload import CHAOS_PARAMS, CONFIGS, Workload
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    hybridkv_transfer_config,
)

# --- servers per configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerShape:
    """The server's limits: the local KV cache (bytes) is what the bench makes too small."""

    kv_cache_bytes: int = 12 << 20
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    store_capacity: str = "1GiB"
    full_store_capacity: str = "4MiB"
    #: CPU cores vLLM's CPU backend leaves to other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``), the same
    #: for every configuration: unset, vLLM reserves one core more when any KV connector is configured, so on
    #: a 2-core host the no-connector server would compute on 1 OpenMP thread and every connector server on 2
    #: (a different speed, and different bf16 rounding that flips greedy near-ties).
    reserved_cpus: int = 1
    #: the local cache of the serial pass's reference server: large enough for every prefix to stay local
    reference_kv_cache_bytes: int = 256 << 20
    #: hybridkv servers log one ``hybridkv step`` event per scheduler step (``step_trace``; ``--trace``)
    step_trace: bool = False

    @property
    def store_capacity_bytes(self) -> int:
        """``store_capacity`` in bytes: every store configuration's size (a Mooncake pool's too)."""
        return parse_size(self.store_capacity, what="store_capacity")


#: Processes of one TP 1 hybridkv server that open its ``mooncake://`` URL, each mounting its ``segment``:
#: the scheduler and the worker.
MOONCAKE_MOUNTS_PER_SERVER = 2


def server_for(
    config: str,
    model: Path,
    workdir: Path,
    shape: ServerShape,
    workload: Workload,
    master: MooncakeMaster | None,
    *,
    log_name: str | None = None,
) -> tuple[OpenAIServer, Path | None]:
    """Start the server of ``config``; returns it and its audit log path (hybridkv configurations)."""
    audit: Path | None = None
    env: dict[str, str] = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(shape.reserved_cpus)}
    kv: dict[str, Any] | None = None
    store_dir = workdir / f"store-{config}"
    if config.startswith("hybridkv"):
        audit = workdir / f"audit-{config}.jsonl"
        if config == "hybridkv-mooncake":
            assert master is not None, "hybridkv-mooncake needs the mooncake master"
            # The same pool bytes as every other configuration: this URL opens a client in the scheduler
            # and one in the worker, each mounting half of it (puts go to the worker's half first, the
            # default placement).
            segment = shape.store_capacity_bytes // MOONCAKE_MOUNTS_PER_SERVER
            store = f"mooncake://{master.address}?segment={segment}&local_buffer=128MiB&timeout_ms=2000"
            env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        elif config == "hybridkv-chaos":
            store = f"faulty+file://{store_dir}?capacity={shape.store_capacity}&{CHAOS_PARAMS}"
        elif config == "hybridkv-full":
            store = f"file://{store_dir}?capacity={shape.full_store_capacity}"
        else:
            store = f"file://{store_dir}?capacity={shape.store_capacity}"
        trace = {"step_trace": True} if shape.step_trace else {}
        kv = hybridkv_transfer_config(store, namespace=f"bench-{config}", audit_log=str(audit), **trace)
    elif config == "mooncake-store":
        assert master is not None, "mooncake-store needs the mooncake master"
        mooncake_config = workdir / "mooncake-store.json"
        mooncake_config.write_text(
            json.dumps(
                {
                    "mode": "embedded",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    # The peer's scheduler has no store client: its one worker mounts the whole pool.
                    "global_segment_size": shape.store_capacity_bytes,
                    "local_buffer_size": 128 << 20,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        env.update(MOONCAKE_CONFIG_PATH=str(mooncake_config), MC_TCP_BIND_ADDRESS="127.0.0.1")
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    elif config != "none":
        raise ValueError(f"unknown serve configuration {config!r}; expected one of {CONFIGS}")
    server = OpenAIServer(
        model,
        workdir / (log_name or f"server-{config}.log"),
        kv_transfer_config=kv,
        max_model_len=shape.max_model_len,
        max_num_seqs=workload.concurrency,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        kv_cache_memory_bytes=shape.kv_cache_bytes,
        extra_env=env,
    )
    return server, audit


_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_CORE_IDS = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")


def engine_core_ids(server_log: str) -> list[int] | None:
    """The CPU cores vLLM bound the engine's OpenMP threads to (CPU backend), or None when not logged."""
    match = _CORE_IDS.search(server_log)
    return [int(x) for x in match.group(1).split(",") if x.strip()] if match else None


def local_cache_tokens(server_log: str) -> int | None:
    """The local KV cache size vLLM logged at start (tokens), or None."""
    match = _KV_TOKENS.search(server_log)
    return int(match.group(1).replace(",", "")) if match else None
