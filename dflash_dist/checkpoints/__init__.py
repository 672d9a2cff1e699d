"""Durable state: the checkpoint store (store.py: atomic, checksummed saves, fallback to the newest valid
one, crash-safe pruning, what a resume checks), the run directory's lineage (lineage.py: roll-backs and
set-aside checkpoints) and one run per run directory (runlock.py). The atomic writes they use are io/'s.

May import: io/, config.py.
"""
