"""Benchmarks, `python -m dflash_dist.bench.NAME`: each prints a table (plan, anchors, attention,
transport, memory, cost, pipeline, colocated, evaluate, regenerate) and gpu_check runs the device
checks in sections. Speed and memory targets are met here, never in timed unit tests.

May import: roles/, evaluation/, forecast/, training/, checkpoints/, plan/, parallel/, data/, models/,
observe/, runtime/, io/, config.py, exits.py: every folder but the report's (and nothing imports these).
"""
