"""Benchmarks, `python -m dflash_dist.bench.NAME`: each prints a table (plan, anchors, attention,
transport, memory, cost, pipeline, colocated, evaluate, regenerate) and gpu_check runs the device
checks in sections. Speed and memory targets are met here, never in timed unit tests.

May import: anything in the package (nothing imports bench/).
"""
