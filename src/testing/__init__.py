"""Public test helpers: stateful Hypothesis fuzzers users can run against their own stores and configs.

Hypothesis is an optional dependency (``hybridkv[testing]``); import the submodules directly:

- ``hybridkv.testing.store_fuzz``      -- store conformance ``RuleBasedStateMachine``
- ``hybridkv.testing.lifecycle_fuzz``  -- lifecycle/geometry ``RuleBasedStateMachine``

The development kit the tests, benchmarks and demo share (tiny models, the in-process vLLM harness, the
simulated cluster, ...) is :mod:`hybridkv.devkit`, not a public API.
"""
