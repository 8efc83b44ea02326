"""Benchmarks behind ``hybridkv bench``: one module per benchmark, each a pure function returning a
JSON-ready report dict, plus ``report`` (tables, JSON files, PNG plots). The CLI only parses arguments.

- ``store``      -- put/get GB/s per backend and value size next to memcpy of the same bytes
- ``lifecycle``  -- microseconds per transition and per request lifecycle
- ``lookup``     -- the connector's scheduler-side lookup vs the bare store existence call
- ``ttft``       -- time to first token through a real in-process vLLM engine
- ``datapath``   -- KV block gather/scatter vs one contiguous copy (``python -m hybridkv.bench.datapath``)

Registering the CLI imports none of these; vLLM and torch are imported only when a benchmark runs.
"""
