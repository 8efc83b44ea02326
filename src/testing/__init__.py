"""Public test helpers: stateful Hypothesis fuzzers users can run against their own stores and configs.

Hypothesis is an optional dependency (``hybridkv[testing]``); import the submodules directly:

- ``hybridkv.testing.store_fuzz``      -- store conformance ``RuleBasedStateMachine``
- ``hybridkv.testing.lifecycle_fuzz``  -- lifecycle/geometry ``RuleBasedStateMachine``

Their parts (import the two above): ``store_model`` (what the store machine checks a store's answers
against), ``lifecycle_rules`` (the lifecycle machine's rule groups), ``fault_patterns`` (the seeded
positional faults the lifecycle machine puts in front of its model store).

The development kit the tests, benchmarks and demo share (tiny models, the in-process vLLM harness, the
simulated cluster, ...) is :mod:`hybridkv_dev.devkit`, not a public API.
"""
