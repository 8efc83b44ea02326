"""``worker_cpus: auto`` in a served engine: the connector's worker threads leave the OpenMP main thread's
core for the CPUs vLLM keeps out of its OpenMP binding.

vLLM's CPU backend hands its worker process an OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``); the OpenMP
runtime pins the worker's main thread to the binding's first core, and every thread started from the main
thread inherits that core. Here the binding is ``0`` (one OpenMP thread, on CPU 0), so CPU 1 is outside it,
as the cores vLLM reserves for a connector are on a larger host (on this 2-core host vLLM's ``auto`` binding
has no core to spare). The test reads every thread's CPUs from ``/proc`` and checks that an external hit,
loaded by the moved threads, gives the cold run's tokens.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv_dev.devkit.openai_server import OpenAIServer, hybridkv_transfer_config, metric, wait_metric

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [grandchild for child in children for grandchild in _descendants(int(child))]


def _thread_cpus(pid: int) -> dict[int, str]:
    """Thread id -> its ``Cpus_allowed_list`` (threads that ended meanwhile are left out)."""
    out: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        out[int(tid)] = next(
            line for line in status.splitlines() if line.startswith("Cpus_allowed_list")
        ).split()[1]
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for OpenMP, one outside it")
def test_worker_threads_run_outside_the_openmp_binding(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    openmp_cpu, spare_cpus = cpus[0], cpus[1:]
    model = build_tiny_model("llama", DEFAULT_MODELS_DIR)
    rng = random.Random(11)
    tokens = [rng.randrange(3, 500) for _ in range(300)]
    server = OpenAIServer(
        model,
        tmp_path / "server.log",
        kv_transfer_config=hybridkv_transfer_config(
            f"file://{tmp_path}/store?capacity=256MiB", namespace="cpus", worker_cpus="auto"
        ),
        tokenizer=False,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": str(openmp_cpu)},
    )
    with server:
        server.wait_healthy()
        cold = server.complete_ids(tokens)
        wait_metric(server.base_url, "vllm:hybridkv_save_keys_total", 1)

        [worker] = [
            pid
            for pid in _descendants(server.proc.pid)
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker")
        ]
        thread_cpus = _thread_cpus(worker)
        spare_text = ",".join(str(cpu) for cpu in spare_cpus) if len(spare_cpus) == 1 else None
        assert thread_cpus[worker] == str(openmp_cpu), f"OpenMP did not pin the main thread: {thread_cpus}"
        moved = [tid for tid, text in thread_cpus.items() if text != str(openmp_cpu)]
        # The load thread, its reader and the save thread at least (and what they started).
        assert len(moved) >= 3, f"the connector's threads stayed on the OpenMP core: {thread_cpus}"
        if spare_text is not None:
            assert all(thread_cpus[tid] == spare_text for tid in moved), thread_cpus

        server.reset_prefix_cache(attempts=5)
        warm = server.complete_ids(tokens)
        samples = wait_metric(server.base_url, "vllm:external_prefix_cache_hits_total", 1)
        assert warm == cold, "tokens differ after an external hit loaded by the moved threads"
        assert metric(samples, "vllm:hybridkv_load_keys_total") > 0
        assert "hybridkv: worker threads" in server.log_text()
