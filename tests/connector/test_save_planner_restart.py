"""After a truncated load, a request saves again the prompt tails the truncation may have removed (issue 34,
item 8c).

MLA 16 x DCP 4 (span 64) + Mamba 96, hash unit 32: a 360-token prompt hands its Mamba state off at 352,
inside full-attention block 5 (320..384), so the planner saves that block under 352 as well (a prompt tail:
without it no lookup reaches the state). Say the request is then preempted, and its resumed lookup loads its
own entries: the tail reads back ``CORRUPT``, the load is truncated, the tail is removed, and
``RequestSaves.restart()`` runs. vLLM recomputes the request and hands the state at 352 off again: the tail
must be planned again. The planner is driven directly (its inputs are vLLM's step outputs), on the geometry
vLLM resolves for that configuration.
"""

from __future__ import annotations

from typing import Any

import pytest
from hybridkv.connector.metadata import SaveJob
from hybridkv.connector.scheduler.save_planner import RequestSaves, SavePlanner
from hybridkv.connector.scheduler.sessions import RequestSession
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.vllm_geometry import ConnectorGeometry, resolve_geometry
from hybridkv.lifecycle.machine import LifecycleMachine
from hybridkv_dev.devkit.cluster import hybrid_config
from support.scheduler import make_request

pytestmark = pytest.mark.vllm

PROMPT = 360
#: Where the prompt's Mamba state is handed off: the last hash boundary the prompt's block hashes cover.
STATE_AT = 352
FULL, MAMBA = 0, 1


class Publisher:
    """Where the planner publishes stored waves (none finish in this test)."""

    reset_epoch = 0

    def publish_stored(self, epoch: int, stored: list[Any], session: RequestSession | None) -> None:
        raise AssertionError("no wave finishes in this test")


class BlockTable:
    """A step's ``kv_connector_block_state``: the request's block ids per vLLM group."""

    def __init__(self, block_ids: tuple[list[int], ...]) -> None:
        self._block_ids = block_ids

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._block_ids


@pytest.fixture(scope="module")
def geo() -> ConnectorGeometry:
    vc, kvc = hybrid_config("mla_mamba96", dcp=4, tp=4)
    geo = resolve_geometry(vc, kvc, "restart", check_vllm_sizes=True)
    assert [(g.span, g.vllm_group_index) for g in geo.groups] == [(64, FULL), (96, MAMBA)]
    assert geo.geometry.hit_alignment == 32
    return geo


def _saved(job: SaveJob | None) -> set[tuple[int, int]]:
    """(group_index, key boundary) of every entry ``job`` saves."""
    return set() if job is None else {(ref.group_index, ref.key_boundary) for ref in job.blocks}


def test_a_restart_after_a_truncated_load_saves_the_prompt_tail_again(geo: ConnectorGeometry) -> None:
    planner = SavePlanner(geo, LifecycleMachine(geo.scheme), StatsBox(), Publisher(), frozenset(range(4)))
    saves = RequestSaves(make_request("r", PROMPT, first=7000))
    table = BlockTable(([11, 12, 13, 14, 15, 16], [21, 22, 23, 24]))
    state = [(MAMBA, 24, STATE_AT)]
    whole_blocks = {(FULL, 64 * (i + 1)) for i in range(STATE_AT // 64)}
    tail = (FULL, STATE_AT)

    first = _saved(planner.step_job(saves, STATE_AT, table, state, 0))
    assert first == whole_blocks | {tail, (MAMBA, STATE_AT)}, first

    # The request's resumed load (of its own entries) was truncated: its tail removed, vLLM recomputes.
    saves.loaded_boundary = STATE_AT
    saves.restart()
    again = _saved(planner.step_job(saves, STATE_AT, table, state, 0))
    assert tail in again, f"the recompute saves {sorted(again)}: the removed tail is never saved again"
    assert again == first, "a restart re-plans what the request saved, no more"
