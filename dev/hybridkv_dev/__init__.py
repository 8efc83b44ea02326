"""hybridkv's development distribution: the development kit (``devkit``), the benchmarks only developers
run (``bench``) and their commands (``cli``, joined to the ``hybridkv`` command through the ``hybridkv.commands``
entry point group). It builds on the product (``hybridkv``); nothing in the product imports it. Installed by
``make`` from the repository; never by ``pip install hybridkv``.
"""
