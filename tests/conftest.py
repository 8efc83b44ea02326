"""Test-wide settings: Hypothesis profiles and process logging (the library never configures logging)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import HealthCheck, settings

# `ci` is the default: minutes for the whole suite on 2 cores, and the same examples on every run
# (derandomized, no example database): a suite that passes passes again, so a landing never depends on the
# draw. Random exploration is `long`'s, where a failure is a finding (its database keeps it for replay):
#   make fuzz-long        (or: pytest --hypothesis-profile=long)
settings.register_profile(
    "ci",
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", max_examples=15, stateful_step_count=20, deadline=None)
settings.load_profile(os.environ.get("HYBRIDKV_HYPOTHESIS_PROFILE", "ci"))

logging.basicConfig(level=logging.WARNING)
structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    cache_logger_on_first_use=False,
)

# Race hunting (`make test-races`): HYBRIDKV_SWITCH_INTERVAL=1e-6 makes the interpreter
# switch threads after every few bytecodes, so interleavings that a normal run almost never takes happen
# all the time; run it with PYTHONDEVMODE=1 (the interpreter's own checks) and faulthandler's timeout.
if os.environ.get("HYBRIDKV_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["HYBRIDKV_SWITCH_INTERVAL"]))


@pytest.fixture(scope="module", autouse=True)
def no_vllm_world_left_behind() -> Iterator[None]:
    """After a module's tests (and its module fixtures: this autouse fixture is set up first, so torn down
    last), vLLM's process-wide parallel state is torn down if an in-process engine left it initialized.

    An in-process ``vllm.LLM`` initializes the world and model-parallel groups and its shutdown leaves them
    in place; a later module in the same process that plays a TP worker by hand would then read the
    leftover 1-rank group (``read_ranks`` trusts an initialized world group, as a real worker must)."""
    yield
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is None or getattr(parallel_state, "_WORLD", None) is None:
        return
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
