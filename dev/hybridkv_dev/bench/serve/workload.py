"""The serve bench's configurations and its workload: the conversations the clients send."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

CONFIGS: tuple[str, ...] = (
    "none",
    "hybridkv-file",
    "hybridkv-mooncake",
    "mooncake-store",
    "hybridkv-chaos",
    "hybridkv-full",
)
MOONCAKE_CONFIGS = frozenset({"hybridkv-mooncake", "mooncake-store"})
#: Configurations whose serial pass must reproduce the reference's greedy tokens exactly: every evicted prefix
#: comes back from the store (no faults, room for all of it).
EXACT_CONFIGS = frozenset({"hybridkv-file", "hybridkv-mooncake"})
#: Faults of ``hybridkv-chaos``: failed and corrupted gets, failed puts and existence checks.
CHAOS_PARAMS = "get_fail=0.1&put_fail=0.1&exists_fail=0.05&corrupt=0.05&seed=7"

_WORDS = [
    "cache",
    "store",
    "block",
    "prefix",
    "token",
    "session",
    "turn",
    "answer",
    "question",
    "model",
    "layer",
    "state",
    "window",
    "memory",
    "latency",
    "request",
    "system",
    "user",
    "engine",
    "worker",
    "scheduler",
    "load",
    "save",
    "evict",
    "hit",
    "miss",
    "key",
    "value",
    "batch",
    "stream",
    "queue",
    "policy",
    "budget",
    "replica",
    "master",
    "segment",
    "lease",
    "timeout",
    "retry",
    "audit",
    "metric",
    "counter",
    "gauge",
    "trace",
    "config",
]


@dataclass(frozen=True)
class Workload:
    """What the clients send. Sizes are in words (about 3.3 tokens each with the tiny models' tokenizer)."""

    num_sessions: int = 16
    num_turns: int = 4
    concurrency: int = 2
    num_system_prompts: int = 2
    system_prompt_words: int = 100
    user_turn_words: int = 60
    max_tokens: int = 16
    num_evict_prompts: int = 6
    evict_prompt_words: int = 400
    seed: int = 0
    #: top log-probabilities asked per generated token (0: none): how near a tie each greedy choice was,
    #: which tells batching noise from a wrong token where two runs disagree
    num_top_logprobs: int = 2

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "concurrency", "num_system_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")


def seeded_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def system_prompt(workload: Workload, index: int) -> str:
    rng = random.Random(f"system-{workload.seed}-{index}")
    return f"You are assistant number {index}. " + seeded_words(rng, workload.system_prompt_words)


def user_turn(workload: Workload, session: int, turn: int) -> str:
    rng = random.Random(f"user-{workload.seed}-{session}-{turn}")
    return f"Session {session}, question {turn}: " + seeded_words(rng, workload.user_turn_words) + "?"


def conversation_messages(workload: Workload, session: int, answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of ``session``'s turn ``len(answers)``: its system prompt, then each earlier user turn
    followed by the model's answer to it, then the new user turn."""
    messages = [{"role": "system", "content": system_prompt(workload, session % workload.num_system_prompts)}]
    for turn, answer in enumerate(answers):
        messages.append({"role": "user", "content": user_turn(workload, session, turn)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": user_turn(workload, session, len(answers))})
    return messages
