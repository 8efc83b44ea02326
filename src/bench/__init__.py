"""Benchmarks behind ``hybridkv bench``: one module per benchmark (a package, split by responsibility, where one
module would pass 600 lines), each a pure function returning a JSON-ready report dict.

- ``harness``    -- what every bench shares: rounds and the interleaving of arms, the host's load average,
  medians and spreads, the per-request record of the serving benches (and ``report``'s targets table, JSON
  and PNG writing)
- ``report``     -- the targets table, JSON reports, PNG plots
- ``store``      -- put/get GB/s per backend and value size next to memcpy of the same bytes
- ``lifecycle``  -- microseconds per transition and per request lifecycle
- ``lookup``     -- the connector's scheduler-side lookup vs the bare store existence call
- ``scheduler``  -- vLLM's real ``Scheduler`` with and without the connector at K3-like geometry
- ``ttft``       -- time to first token through a real in-process vLLM engine
- ``datapath``   -- KV block gather/scatter vs one contiguous copy (``python -m hybridkv.bench.datapath``)
- ``serve``, ``soak``, ``agentic_serve`` -- real OpenAI servers under load
- ``agentic``, ``agentic_policies``, ``divergent``, ``crosshost``, ``scale`` -- the rest (see each docstring)

Registering the CLI imports none of these; vLLM and torch are imported only when a benchmark runs.
"""
