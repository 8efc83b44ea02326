"""The scheduler wing: the connector's half that runs in vLLM's scheduler process.

``side`` (:class:`SchedulerSide`, what the facade's scheduler-role methods call) answers
``get_num_new_matched_tokens`` through the lookup (``lookup_answers``: the ask of one request in flight,
answered or expired, as the lifecycle decides it; ``lookup_service`` / ``lookup_process`` and
``lookup_child``: where the store is asked, in a thread or a child process), binds hits to vLLM's allocation
and judges their loads (``loads``), plans saves (``save_planner``, ``sessions``), keeps each request's state
(``request_state``), guards vLLM's block pool (``vllm_blocks``), publishes KV events (``store_events``),
runs the store's upkeep (``store_upkeep``, ``maintenance``), rotates the weights tag (``namespace_gate``)
and withholds layer-wise hits after a missed deadline (``layerwise_breaker``).

It imports the shared modules of :mod:`hybridkv.connector` and never the worker or data-path wings: what it
tells the workers travels in the step's metadata (:mod:`hybridkv.connector.metadata`).
"""
