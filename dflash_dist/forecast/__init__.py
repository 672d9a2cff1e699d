"""Before the run: the memory model (memory.py: each role's peak at the worst batch, the pre-flight and
bench.memory), the cost model (cost.py: FLOPs, bytes and seconds per batch, the best role split), and
the models' shapes both read (shapes.py: from the config, a config.json or built-in public shapes).

May import: training/, plan/, parallel/, data/, models/, observe/, io/, config.py, exits.py.
"""
