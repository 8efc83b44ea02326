"""What a soak runs: the chaos faults, the gauges it samples, its conversations (``SoakPlan``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv_dev.bench.serve import Workload

#: Faults of the chaos view: failed, corrupted and late (answered TIMEOUT, finished 200 ms later) gets and
#: puts, failed existence checks.
DEFAULT_CHAOS = (
    "get_fail=0.1&put_fail=0.1&exists_fail=0.05&corrupt=0.05&get_late=0.05&put_late=0.05&late_ms=200&seed=3"
)

#: sample key -> ``/metrics`` series (docs/metrics.md): what the connector holds now.
CONNECTOR_GAUGES: dict[str, str] = {
    "tracked_requests": "vllm:hybridkv_tracked_requests",
    "pinned_blocks": "vllm:hybridkv_pinned_blocks",
    "save_inflight_bytes": "vllm:hybridkv_save_inflight_bytes",
    "staging_bytes_out": "vllm:hybridkv_staging_bytes_out",
    "late_calls_pending": "vllm:hybridkv_late_calls_pending",
    "audit_queued_records": "vllm:hybridkv_audit_queued_records",
}
#: The gauges a settled engine holds at zero (``settle`` waits for them).
HELD_GAUGES = (
    "tracked_requests",
    "pinned_blocks",
    "save_inflight_bytes",
    "staging_bytes_out",
    "late_calls_pending",
)


#: The soak's conversations: 4 open sessions of 3 turns, 2 clients, short prompts, no eviction prompts.
SOAK_WORKLOAD = Workload(
    num_sessions=4,
    num_turns=3,
    concurrency=2,
    system_prompt_words=60,
    user_turn_words=50,
    max_tokens=8,
    num_evict_prompts=0,
    num_top_logprobs=0,
)


#: Bytes per element of each engine dtype the soak takes (``SoakPlan.dtype``).
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
SOAK_DTYPES = tuple(DTYPE_BYTES)


def sized_for_dtype(num_bytes: int, dtype: str) -> int:
    """``num_bytes`` sized for bfloat16 (``SoakPlan``'s byte defaults), scaled to hold as many tokens in ``dtype``."""
    return num_bytes * DTYPE_BYTES[dtype] // DTYPE_BYTES["bfloat16"]


@dataclass(frozen=True)
class SoakPlan:
    """What the soak sends, to which server. Prompt sizes are in words (about 3.3 tokens each)."""

    num_requests: int = 1000
    sample_every: int = 25
    #: the conversations (``hybridkv_dev.bench.serve.Workload``): ``num_sessions`` open at once (a finished one's
    #: slot goes to a new conversation) of ``num_turns`` turns, ``concurrency`` clients, prompt sizes
    workload: Workload = field(default_factory=lambda: SOAK_WORKLOAD)
    #: every this-many-th request is aborted after its first streamed chunk (0: none)
    abort_every: int = 9
    #: after every this-many-th request, ``POST /reset_prefix_cache``; every other one with the connector's
    #: reset (0: none)
    reset_every: int = 40
    #: sessions of the serial exactness pass (0: skip it)
    serial_sessions: int = 2
    warmup_fraction: float = 0.25
    #: the server's local KV cache: about 12 blocks of 128 tokens of the tiny GDN hybrid in bfloat16, a third of
    #: what the open sessions resend (``sized_for_dtype`` for another dtype)
    kv_cache_bytes: int = 6 << 20
    max_model_len: int = 1024
    #: the file store's capacity: about 10 entries of the tiny GDN hybrid in bfloat16, below what the sessions save
    store_capacity_bytes: int = 6 << 20
    chaos: str = DEFAULT_CHAOS
    #: CPU cores vLLM's CPU backend leaves to other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``)
    reserved_cpus: int = 1
    #: the engines' ``--dtype``: ``bfloat16`` crawls on a CPU without AVX-512 (bf16 is emulated there), where
    #: ``float32`` serves several times the requests per minute; a leak is per request either way
    dtype: str = "bfloat16"
    #: a request still unanswered after this long fails (a stranded request must not hang the soak); the
    #: tiny models answer in well under a second
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "sample_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"SoakPlan.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_sessions", "num_turns", "concurrency", "max_tokens"):
            if getattr(self.workload, name) < 1:
                raise ValueError(f"SoakPlan.workload.{name} must be >= 1, got {getattr(self.workload, name)}")
        for name in ("abort_every", "reset_every", "serial_sessions", "reserved_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"SoakPlan.{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in SOAK_DTYPES:
            raise ValueError(f"SoakPlan.dtype must be one of {', '.join(SOAK_DTYPES)}, got {self.dtype!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"SoakPlan.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"SoakPlan.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
