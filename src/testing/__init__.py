"""Public test helpers: stateful Hypothesis fuzzers users can run against their own stores and configs.

Hypothesis is an optional dependency (``pip install hybridkv[testing]``); import the submodules directly:

- ``hybridkv.testing.store_fuzz``      -- store conformance ``RuleBasedStateMachine``
- ``hybridkv.testing.lifecycle_fuzz``  -- lifecycle/geometry ``RuleBasedStateMachine``
"""
