"""``hybridkv demo``: the seed scenario on a real vLLM engine (``scenario``: one function per phase) and its
operator-facing report (``report``). vLLM is imported only when ``run_demo`` runs."""

from __future__ import annotations

from hybridkv.demo.report import render
from hybridkv.demo.scenario import (
    DEFAULT_CHAOS,
    Check,
    DemoOptions,
    DemoReport,
    PhaseResult,
    RequestResult,
    chaos_url,
    make_prompt,
    run_demo,
    shared_prefix_length,
)

__all__ = [
    "DEFAULT_CHAOS",
    "Check",
    "DemoOptions",
    "DemoReport",
    "PhaseResult",
    "RequestResult",
    "chaos_url",
    "make_prompt",
    "render",
    "run_demo",
    "shared_prefix_length",
]
