"""The operator wing: what the operator commands compute, over the product, with no argument parsing.

``hybridkv.cli`` parses arguments, prints and maps outcomes to exit codes; the work behind its operator
commands lives here, importable by other front ends (the development kit, the benches, the demo):

- ``hybridkv.ops.describe``        -- ``hybridkv describe``: the whole report and its text rendering
- ``hybridkv.ops.geometry``        -- the geometry an in-process engine resolves for a model
- ``hybridkv.ops.store_health``    -- a store's health (timed existence checks, breakers), usage, key counts
- ``hybridkv.ops.store_admin``     -- ``hybridkv store ls|stats|clear``: listing, deployments, stats, clear
- ``hybridkv.ops.mooncake_deploy`` -- ``hybridkv mooncake master|node|up``: processes, signals, URL hints
- ``hybridkv.ops.inprocess``       -- the in-process vLLM engine with the connector (the product's launcher)

Layering (``tests/static/test_layers.py``): ops imports ``tables``, ``lifecycle``, ``audit``, ``store`` and
``connector``; the CLI and the tooling import ops; ops never imports the CLI or the tooling. Nothing here
configures logging, and vLLM is imported only inside the functions that start an engine.
"""
