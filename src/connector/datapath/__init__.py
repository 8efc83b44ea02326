"""The data-path wing: moving KV blocks between vLLM's pages and the store's values.

``movers`` (:class:`BlockMover`, the contract, with ``DirectMover`` for caches the CPU reaches and the
``block_mover`` factory), ``staged_mover`` (device caches through a pinned host slab), ``staging`` (the
slab and its lanes) and ``copy_kernels`` (the optional Triton gather/scatter).

It imports nothing of the connector's wings (the worker wing drives it) and no vLLM: only torch.
"""
