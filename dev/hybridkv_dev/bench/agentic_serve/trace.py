"""The serve trace: the agentic trace scaled to what real servers of the tiny model take, and each request's
body."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model

from hybridkv_dev.bench.agentic import (
    AgenticWorkload,
    RequestKind,
    generate_trace,
)

BASELINE = "file-lru"
SESSIONS_CONFIGURATION = "file-lru+sessions"
MOONCAKE_CONFIGURATION = "mooncake-store"
CONFIGURATIONS: tuple[str, ...] = (BASELINE, SESSIONS_CONFIGURATION, MOONCAKE_CONFIGURATION, "none")
HYBRIDKV_CONFIGURATIONS = frozenset({BASELINE, SESSIONS_CONFIGURATION})
#: The store bench's token scale (``AgenticWorkload``'s token counts are at it).
_WORKLOAD_TOKEN_SCALE = 64
#: The store bench's sessions and arrival window: the serve trace keeps sessions / window.
_WORKLOAD_SESSIONS = 24
_WORKLOAD_ARRIVAL_S = 1800.0
#: Token ids 0..2 are the tiny models' pad/bos/eos.
FIRST_TOKEN_ID = 3
#: Windows of the hit share over the trace (the plot).
NUM_WINDOWS = 20
NAMESPACE = "bench-agentic-serve"
#: The tiny Llama with 4 KV heads of 128 (4 KiB of KV per token, 128 KiB per 32-token block; 2 layers,
#: hidden 128): a working set of a few hundred requests is then over 64 MiB, so a quarter of it reaches
#: Mooncake's smallest global segment (16 MiB), and the compute stays that of the tiny model.
MODEL_OVERRIDES: dict[str, Any] = {"num_key_value_heads": 4, "head_dim": 128}
MIB = float(1 << 20)
#: A server not healthy by then failed (vLLM's API server can outlive an engine core that died at start).
START_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class ServeSetup:
    """The bench's knobs: the trace's scale, the engines' shape and the store's capacity."""

    num_sessions: int = 16
    #: the trace is cut to its first this many requests (time order), after the too-long ones are left out
    max_requests: int = 600
    #: real tokens per trace token (the store bench's is 64)
    token_scale: int = 256
    #: the engine's KV block (``--block-size``) and the trace's hash block
    block_tokens: int = 32
    max_tokens: int = 4
    concurrency: int = 1
    #: the store capacity C of every configuration, a fraction of the trace's working set
    capacity_fraction: float = 0.25
    #: the engine's local KV cache (``--kv-cache-memory-bytes``), MiB
    kv_cache_mib: float = 10.0
    max_model_len: int = 2048
    session_ttl_s: float = 3600.0
    #: ``VLLM_CPU_NUM_OF_RESERVED_CPU``, the same for every configuration (see ``ServerShape.reserved_cpus``)
    reserved_cpus: int = 1
    #: Mooncake's per-client transfer buffer (``local_buffer_size``)
    mooncake_local_buffer_mib: int = 32

    def __post_init__(self) -> None:
        checks = {
            "num_sessions >= 1": self.num_sessions >= 1,
            "max_requests >= 1": self.max_requests >= 1,
            "token_scale >= 1": self.token_scale >= 1,
            "block_tokens >= 1": self.block_tokens >= 1,
            "1 <= max_tokens < max_model_len": 1 <= self.max_tokens < self.max_model_len,
            "concurrency 1 or 2": self.concurrency in (1, 2),
            "capacity_fraction > 0": self.capacity_fraction > 0,
            "kv_cache_mib > 0": self.kv_cache_mib > 0,
            "session_ttl_s in (0, 86400]": 0 < self.session_ttl_s <= 86400,
            "reserved_cpus >= 0": self.reserved_cpus >= 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"ServeSetup: need {', '.join(failed)}")

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - self.max_tokens


def serve_workload(setup: ServeSetup) -> AgenticWorkload:
    """The store bench's workload at ``setup``'s token scale, session count and block size: every token count
    times 64 / ``token_scale``, the arrival window scaled like the session count."""
    factor = _WORKLOAD_TOKEN_SCALE / setup.token_scale
    base = AgenticWorkload()
    return replace(
        base,
        num_sessions=setup.num_sessions,
        token_scale=setup.token_scale,
        block_tokens=setup.block_tokens,
        system_prompt_tokens=max(1, round(base.system_prompt_tokens * factor)),
        user_task_tokens=max(1, round(base.user_task_tokens * factor)),
        model_output_median_tokens=max(1.0, base.model_output_median_tokens * factor),
        tool_output_median_tokens=max(1.0, base.tool_output_median_tokens * factor),
        subagent_task_tokens=max(1, round(base.subagent_task_tokens * factor)),
        one_off_median_tokens=max(float(setup.block_tokens + 1), base.one_off_median_tokens * factor),
        session_arrival_window_s=_WORKLOAD_ARRIVAL_S * setup.num_sessions / _WORKLOAD_SESSIONS,
    )


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay: its token ids (in the model's vocabulary) and what it waits for."""

    index: int  # position in the replay
    trace_index: int  # position in the generated trace
    chain: int
    kind: RequestKind
    tenant: str
    prompt: tuple[int, ...] = field(repr=False)
    block_hashes: tuple[bytes, ...] = field(repr=False)
    #: the session hint's id (``None``: a one-off, no hint) and whether this is its chain's last request
    session_id: str | None
    session_end: bool
    #: replay indices that must be answered before this one is sent (concurrency > 1)
    after: tuple[int, ...]
    time_s: float

    @property
    def cache_salt(self) -> str:
        return f"salt:{self.tenant}"


@dataclass(frozen=True)
class ServeTrace:
    """A generated trace cut to what the engines replay."""

    seed: int
    workload: AgenticWorkload
    requests: tuple[ReplayRequest, ...]
    num_trace_requests: int
    num_too_long: int
    num_cut: int

    def working_set_blocks(self) -> int:
        """Distinct whole prompt blocks (per tenant) of the replay: what an unbounded store ends up holding."""
        return len({(r.tenant, h) for r in self.requests for h in r.block_hashes})

    def ideal_hit_tokens(self) -> list[int]:
        """Per request, the hit of an unbounded store with an attention-only model and no local cache: the
        deepest whole block, at most the prompt less one token, that an earlier request of its tenant
        stored (vLLM hashes prefixes, so a block present means every block before it is)."""
        block = self.workload.block_tokens
        stored: set[tuple[str, bytes]] = set()
        hits: list[int] = []
        for request in self.requests:
            cap = min(len(request.prompt) - 1, len(request.block_hashes) * block) // block
            hit = next(
                (
                    n * block
                    for n in range(cap, 0, -1)
                    if (request.tenant, request.block_hashes[n - 1]) in stored
                ),
                0,
            )
            hits.append(hit)
            stored.update((request.tenant, h) for h in request.block_hashes)
        return hits

    def shape(self) -> dict[str, Any]:
        prompts = [len(r.prompt) for r in self.requests]
        ideal = self.ideal_hit_tokens()
        return {
            "seed": self.seed,
            "token_scale": self.workload.token_scale,
            "block_tokens": self.workload.block_tokens,
            "num_sessions": len({r.chain for r in self.requests if r.kind is RequestKind.TURN}),
            "num_trace_requests": self.num_trace_requests,
            "num_too_long": self.num_too_long,
            "num_cut": self.num_cut,
            "num_requests": len(self.requests),
            "num_requests_by_kind": {
                kind.value: sum(r.kind is kind for r in self.requests) for kind in RequestKind
            },
            "tenants": sorted({r.tenant for r in self.requests}),
            "prompt_tokens": sum(prompts),
            "prompt_tokens_median": float(statistics.median(prompts)) if prompts else 0.0,
            "prompt_tokens_max": max(prompts, default=0),
            "span_s": self.requests[-1].time_s if self.requests else 0.0,
            "working_set_blocks": self.working_set_blocks(),
            "ideal_share": sum(ideal) / max(1, sum(prompts)),
        }


def build_serve_trace(setup: ServeSetup, seed: int, vocab_size: int) -> ServeTrace:
    """The trace of ``serve_workload(setup)`` for ``seed``, without the prompts that do not fit, cut to
    ``setup.max_requests`` requests, token ids mapped into ``vocab_size`` (pure)."""
    workload = serve_workload(setup)
    trace = generate_trace(workload, seed)
    fitting = [r for r in trace.requests if r.num_prompt_tokens <= setup.max_prompt_tokens]
    kept = fitting[: setup.max_requests]
    chain_to_last = {r.chain: position for position, r in enumerate(kept)}
    parent_of = {c.chain: c.parent for c in trace.chains}
    children_of: dict[int, list[int]] = {}
    for chain in trace.chains:
        if chain.parent is not None:
            children_of.setdefault(chain.parent, []).append(chain.chain)
    #: the replay index of the latest request of each chain so far
    latest: dict[int, int] = {}
    modulus = vocab_size - FIRST_TOKEN_ID
    requests: list[ReplayRequest] = []
    for position, r in enumerate(kept):
        related = [r.chain, *children_of.get(r.chain, ())]
        parent = parent_of[r.chain]
        if parent is not None:
            related.append(parent)
        after = tuple(sorted({latest[c] for c in related if c in latest}))
        latest[r.chain] = position
        one_off = r.kind is RequestKind.ONE_OFF
        requests.append(
            ReplayRequest(
                index=position,
                trace_index=r.index,
                chain=r.chain,
                kind=r.kind,
                tenant=r.tenant,
                prompt=tuple(FIRST_TOKEN_ID + t % modulus for t in trace.prompt_tokens(r)),
                block_hashes=r.block_hashes,
                session_id=None if one_off else f"{r.tenant}/chain-{r.chain}",
                session_end=not one_off and chain_to_last[r.chain] == position,
                after=after,
                time_s=r.time_s,
            )
        )
    return ServeTrace(
        seed=seed,
        workload=workload,
        requests=tuple(requests),
        num_trace_requests=len(trace.requests),
        num_too_long=len(trace.requests) - len(fitting),
        num_cut=len(fitting) - len(kept),
    )


def bench_model(models_dir: Path | None = None) -> Path:
    """The bench's model (the tiny Llama with ``MODEL_OVERRIDES``), built once under ``models_dir`` (default:
    ``$HYBRIDKV_TEST_MODELS``, ``hybridkv.demo.tiny_models.DEFAULT_MODELS_DIR``)."""
    return build_tiny_model("llama", models_dir or DEFAULT_MODELS_DIR, **MODEL_OVERRIDES)


def attention_block_bytes(model_dir: Path, block_tokens: int, dtype_bytes: int = 2) -> int:
    """KV bytes of one ``block_tokens`` block of ``model_dir``'s full-attention layers (bfloat16): layers x
    K and V x kv heads x head dim x tokens x 2 bytes. Exact for an attention-only model (the tiny Llama)."""
    config = json.loads((model_dir / "config.json").read_text())
    layer_types = config.get("layer_types")
    num_layers = (
        sum(1 for t in layer_types if t in ("full_attention", "attention"))
        if layer_types
        else int(config["num_hidden_layers"])
    )
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return num_layers * 2 * heads * head_dim * block_tokens * dtype_bytes


def model_vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# -- one configuration ----------------------------------------------------------------------------------------


def request_body(request: ReplayRequest, configuration: str, setup: ServeSetup) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request`` under ``configuration`` (the session hint only for
    ``file-lru+sessions``)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(request.prompt),
        "max_tokens": setup.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": request.cache_salt,
    }
    if configuration == SESSIONS_CONFIGURATION and request.session_id is not None:
        body["kv_transfer_params"] = {
            "hybridkv_session": {
                "id": request.session_id,
                "ttl_s": setup.session_ttl_s,
                "end": request.session_end,
            }
        }
    return body
