"""Where the worker half's threads run (``worker_cpus``, ``hybridkv.connector.worker.cpus``): the OpenMP
binding vLLM hands a CPU worker, read from its variables, and the CPUs the connector's threads move to.
The served engine's threads are checked in ``tests/serve/test_worker_cpus_served.py``."""

from __future__ import annotations

import os
import threading

import pytest
from hybridkv.connector.config import ConnectorConfig, parse_cpu_list
from hybridkv.connector.worker.cpus import WorkerCpus, openmp_bound_cpus, resolve_worker_cpus

ALL = frozenset(range(16))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", {0}),
        ("0 1 2", {0, 1, 2}),
        ("0,2,4-6", {0, 2, 4, 5, 6}),
        ("0-7:2", {0, 2, 4, 6}),
        (" 3 , 1 ", {1, 3}),
    ],
)
def test_cpu_lists(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", " ", "a", "-1", "3-1", "0-3:0", "0x1", "8192", "1;2"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):  # the message is checked through the config below
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("environ", "bound"),
    [
        ({}, None),
        ({"GOMP_CPU_AFFINITY": "0 1 2 3"}, {0, 1, 2, 3}),  # vLLM with libgomp (the CPU wheel's default)
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1,2]"}, {0, 1, 2}),  # with Intel OpenMP
        ({"OMP_PLACES": "{0,1,2,3}", "OMP_PROC_BIND": "true"}, {0, 1, 2, 3}),  # with another runtime
        ({"OMP_PLACES": "{0:4:2},{9}", "OMP_PROC_BIND": "close"}, {0, 2, 4, 6, 9}),
        ({"OMP_PLACES": "{0,1}"}, None),  # places without binding bind nothing
        ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),  # abstract names: not known
        ({"GOMP_CPU_AFFINITY": "zero"}, None),  # not understood: nothing is moved
    ],
)
def test_openmp_binding_from_the_environment(environ: dict[str, str], bound: set[int] | None) -> None:
    assert openmp_bound_cpus(environ) == (None if bound is None else frozenset(bound))


def test_auto_takes_the_cpus_outside_the_openmp_binding() -> None:
    """vLLM's auto binding on a 16-CPU host with a connector: OpenMP on 0-13, 14 and 15 reserved; the
    worker's main thread is pinned to 0 by then, its parent (the engine process) has all 16."""
    resolved = resolve_worker_cpus(
        "auto",
        environ={"GOMP_CPU_AFFINITY": " ".join(str(cpu) for cpu in range(14))},
        started_with=ALL,
        allowed_now=frozenset({0}),
    )
    assert resolved.cpus == {14, 15}


def test_auto_leaves_threads_where_nothing_is_spare_or_bound() -> None:
    every_cpu_bound = resolve_worker_cpus(
        "auto",
        environ={"GOMP_CPU_AFFINITY": "0 1"},
        started_with=frozenset({0, 1}),
        allowed_now=frozenset({0}),
    )
    assert every_cpu_bound.cpus is None and "every CPU" in every_cpu_bound.reason
    unbound = resolve_worker_cpus("auto", environ={}, started_with=ALL, allowed_now=ALL)
    assert unbound.cpus is None and "no OpenMP binding" in unbound.reason


def test_inherit_and_lists() -> None:
    bound = {"GOMP_CPU_AFFINITY": "0-13"}
    assert (
        resolve_worker_cpus("inherit", environ=bound, started_with=ALL, allowed_now=frozenset({0})).cpus
        is None
    )
    listed = resolve_worker_cpus(
        frozenset({3, 4}), environ=bound, started_with=ALL, allowed_now=frozenset({0})
    )
    assert listed.cpus == {3, 4}
    with pytest.raises(ValueError, match=r"worker_cpus.*\[16, 17\]"):
        resolve_worker_cpus(
            frozenset({15, 16, 17}), environ=bound, started_with=ALL, allowed_now=frozenset({0})
        )


@pytest.mark.parametrize(
    ("value", "parsed"), [(None, "inherit"), ("auto", "auto"), ("12-15", frozenset({12, 13, 14, 15}))]
)
def test_the_config_key(value: str | None, parsed: object) -> None:
    extra = {} if value is None else {"worker_cpus": value}
    assert ConnectorConfig.from_extra_config(extra, model="m").worker_cpus == parsed


@pytest.mark.parametrize("value", ["Auto", "3-1", 3, [1, 2], ""])
def test_the_config_key_refuses_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['worker_cpus'\]: expected"):
        ConnectorConfig.from_extra_config({"worker_cpus": value}, model="m")


def test_a_pinned_thread_runs_on_its_cpus_and_starts_threads_there() -> None:
    """The thread moves itself, and a thread it starts (the store's own) inherits that."""
    own = sorted(os.sched_getaffinity(0))
    target = frozenset(own[-1:])
    seen: dict[str, set[int]] = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def body() -> None:
        seen["thread"] = os.sched_getaffinity(0)
        grandchild = threading.Thread(target=child)
        grandchild.start()
        grandchild.join()

    thread = threading.Thread(target=WorkerCpus(target, "test").run_pinned(body))
    thread.start()
    thread.join()
    assert seen == {"thread": target, "child": target}
    assert sorted(os.sched_getaffinity(0)) == own, "the starting thread keeps its own CPUs"
