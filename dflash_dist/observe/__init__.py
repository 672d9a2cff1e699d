"""What people see while a job runs: the rank-0 monitor thread, its progress record and sinks (monitor.py:
console, JSONL, wandb), progress bars of command-line jobs (bars.py), and the role-split advice
(balance.py). Low in the tree so that data preparation, regeneration and the benchmarks can use them too.

May import: io/ (atomic writes), config.py, exits.py.
"""
