"""Never load into an engine that cannot use it: a tiny DeepSeek-V3 (MLA) on vLLM's reference ``CPU_MLA``.

vLLM turns prefix caching off for that backend ("MLA is enabled on a non-GPU platform; forcing chunked
prefill and prefix caching to be disabled"): its prefill attends over the new tokens only, so KV loaded
under a prompt's first tokens gives wrong tokens (vLLM's ``ExampleConnector`` gives the same wrong ones).
The connector must not load there: cold run, drop the device cache, resend -- no external tokens, the cold
run's tokens. ``hybridkv describe`` on the same engine says loads are off and why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hybridkv.cli import main
from hybridkv.demo.tiny_models import build_tiny_model
from hybridkv.ops import inprocess
from support.engines import MODELS_DIR, connectors, flush_saves, generate, prompt, reset_local_cache

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT_LEN = 300  # 18 full blocks of 16 (the block vLLM forces for CPU_MLA) and a tail


def test_cpu_mla_never_loads_and_keeps_the_cold_tokens(tmp_path: Path) -> None:
    model = build_tiny_model("deepseek_v3", MODELS_DIR)
    transfer = inprocess.connector_transfer_config({"store": f"file://{tmp_path}/store?capacity=256MiB"})
    tokens = prompt(PROMPT_LEN, seed=5)
    with inprocess.inprocess_engine(model, transfer, attention_backend="CPU_MLA") as llm:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False  # vLLM's own fix-up
        cold, cached_cold = generate(llm, tokens)
        flush_saves(llm)
        repeat, cached_repeat = generate(llm, tokens)  # no device prefix cache: only the store could serve it
        reset_local_cache(llm)
        resend, cached_resend = generate(llm, tokens)
        sched, worker = connectors(llm)
        can_load = sched.scheduler_side.can_load
        s_tot, w_tot = dict(sched.scheduler_side.stats.totals), dict(worker.worker_side.stats.totals)
    assert cached_cold == 0
    assert (cached_repeat, cached_resend) == (0, 0), "the store served KV this backend cannot use"
    assert repeat == cold and resend == cold, "tokens differ from the cold run"
    assert not can_load
    assert s_tot.get("lookups", 0) == 0 and w_tot.get("load_bytes", 0) == 0
    assert w_tot["save_bytes"] > 0, "saves continue: the KV is the engine's own"


def test_describe_says_loads_are_off_and_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_tiny_model("deepseek_v3", MODELS_DIR)
    extra = json.dumps({"store": f"file://{tmp_path}/store?capacity=64MiB"})
    argv = ["describe", "--config", extra, "--model", str(model), "--attention-backend", "CPU_MLA"]
    main([*argv, "--json"])
    geometry = json.loads(capsys.readouterr().out)["geometry"]
    assert geometry["loads"] is False and "CPU_MLA" in geometry["loads_off_reason"]
    assert geometry["weights_resolved"] is True and geometry["weights_unresolved"] is None
    main(argv)
    text = capsys.readouterr().out
    assert "loads      OFF: attention backend CPU_MLA" in text and "(saves continue)" in text
