"""Public test helpers: stateful Hypothesis fuzzers users can run against their own stores and configs,
and the tiny models and in-process vLLM engine the tests, benchmarks and demo share.

Hypothesis and vLLM are optional dependencies; import the submodules directly:

- ``hybridkv.testing.store_fuzz``      -- store conformance ``RuleBasedStateMachine`` (``hybridkv[testing]``)
- ``hybridkv.testing.lifecycle_fuzz``  -- lifecycle/geometry ``RuleBasedStateMachine`` (``hybridkv[testing]``)
- ``hybridkv.testing.tiny_models``     -- random-weight model families built locally (no download)
- ``hybridkv.testing.vllm_harness``    -- config builders and an in-process vLLM engine with the connector
- ``hybridkv.testing.cluster``         -- a simulated TP x DCP cluster over one store (scheduler level)
- ``hybridkv.testing.openai_server``   -- vLLM's OpenAI server in a child process, with the connector
- ``hybridkv.testing.delay_proxy``     -- a loopback TCP proxy adding a fixed one-way delay
- ``hybridkv.testing.delayed_mooncake`` -- a real Mooncake master + storage node, the master behind the proxy
"""
