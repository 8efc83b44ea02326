"""One in-process vLLM engine with HybridStoreConnector and vLLM's ZMQ KV-event publisher, run as its own
process by ``test_kv_events.py`` (two of them churn one ``file://`` store).

``python kv_events_engine.py SPEC.json``; SPEC keys: ``name`` (the engine, also its ZMQ topic), ``model``,
``store``, ``endpoint`` (the subscriber's bound ZMQ address: the publisher connects to it), ``control``
(a directory of marker files shared with the test).

Driven by command files: once started it writes ``<name>.done.0``; then for n = 1, 2, ... it waits for
``<name>.cmd.<n>`` (JSON) and answers ``<name>.done.<n>`` (JSON: the batches handed to the publisher so far
and the connector's eviction counters). Commands:

- ``{"op": "churn", "prompts": [[token ids], ...]}``: one request per prompt, then every save written and
  reported (``settle``);
- ``{"op": "flush"}`` (no engine puts meanwhile): each of ``FLUSH_ROUNDS`` rounds waits for the maintenance
  thread (eviction drains, checks of unsure blocks) and runs one request shorter than a block (no save),
  whose step publishes what the round before drained and starts the next drain;
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from support.paths import write_json_whole

#: The drain running when the flush starts (it may predate the last evictions), one after it, one step
#: to publish that one's events.
FLUSH_ROUNDS = 3
WAIT_S = 300.0


def _command(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    command: dict[str, Any] = json.loads(path.read_text())
    return command


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    control = Path(spec["control"])
    name = spec["name"]
    from hybridkv.demo.vllm_harness import PUMP_PROMPT, connector_halves, settle
    from hybridkv.ops import inprocess

    inprocess.prepare_inprocess_environment()
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=spec["endpoint"], topic=name
    )
    transfer = inprocess.connector_transfer_config({"store": spec["store"]})
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with inprocess.inprocess_engine(Path(spec["model"]), transfer, kv_events_config=events_config) as llm:
        publisher = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
        published = [0]
        publish = publisher.publish

        def counted(batch: Any) -> None:
            published[0] += 1
            publish(batch)

        publisher.publish = counted
        side = connector_halves(llm)[0].scheduler_side

        def result() -> dict[str, Any]:
            events = side.events
            return {
                "batches": published[0],
                "tracked": events.num_tracked,
                "evicted_published": events.num_evicted_published,
                "dropped_from_view": events.num_dropped_from_view,
                "lost_reports": events.num_lost_reports,
                "unsure": events.num_unsure,
            }

        write_json_whole(control / f"{name}.done.0", result())
        for n in range(1, 1000):
            command = _command(control / f"{name}.cmd.{n}")
            if command["op"] == "exit":
                break
            if command["op"] == "churn":
                for prompt in command["prompts"]:
                    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                settle(llm)
            else:
                assert command["op"] == "flush", command
                for _ in range(FLUSH_ROUNDS):
                    assert side.wait_maintenance(60), "the maintenance thread did not finish"
                    llm.generate([{"prompt_token_ids": PUMP_PROMPT}], params, use_tqdm=False)
            write_json_whole(control / f"{name}.done.{n}", result())


if __name__ == "__main__":
    main(sys.argv[1])
