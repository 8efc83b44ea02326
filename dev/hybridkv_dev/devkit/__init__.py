"""The development kit the tests, benchmarks and demo share; tooling, not the product's API.

Layering: the devkit may import the product (``hybridkv.lifecycle``, ``store``, ``connector``, ``cli``'s
helpers); nothing in the product imports the devkit (``tests/static/test_layers.py``). vLLM, Hypothesis and
Mooncake are optional; import the submodules directly:

- ``hybridkv_dev.devkit.net``              -- a free loopback TCP port, the loopback-only-namespace check
- ``hybridkv_dev.devkit.mooncake``         -- a ``mooncake_master`` child on 127.0.0.1 (kill / freeze / restart)
- ``hybridkv.demo.tiny_models``      -- random-weight model families built locally (no download)
- ``hybridkv.demo.vllm_harness``     -- config builders and engine steps over ``hybridkv.ops.inprocess``
- ``hybridkv_dev.devkit.cluster``          -- a simulated TP x DCP cluster over one store (scheduler level)
- ``hybridkv_dev.devkit.openai_server``    -- vLLM's OpenAI server in a child process, with the connector
- ``hybridkv_dev.devkit.delay_proxy``      -- a loopback TCP proxy adding a fixed one-way delay
- ``hybridkv_dev.devkit.delayed_mooncake`` -- a real Mooncake master + storage node, the master behind the proxy
"""
