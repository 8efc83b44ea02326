"""The benchmarks only developers run (tiny models, simulated clusters, the in-tree peers). Each states its
workload only: rounds, spreads, targets and reports are the product's :mod:`hybridkv.bench.harness`.
"""
