"""The parts of the lifecycle fuzz machine (``hybridkv.testing.lifecycle_fuzz``), one rule group a module.

- ``model``: the draws (``geometries``, ``family_hashes``), the run's state, the helpers every group shares.
- ``store_side``: fault patterns in front of the model store, earlier saves, evictions, save waves.
- ``lookups``: new requests and their lookups (the search against the full scan; hard rule 1 on hits).
- ``loads``: hits taken, declined or refused, resets, loads and their retry caps, requests leaving.

``hybridkv.testing.lifecycle_fuzz.LifecycleFuzzMachine`` inherits every group and adds the scenarios that
span them, the invariants and the teardown; Hypothesis collects the rules of all of them.
"""
