"""Durable state: the checkpoint store (store.py: atomic, checksummed saves, fallback to the newest valid
one, crash-safe pruning, what a resume checks), the run directory's lineage (lineage.py: roll-backs and
set-aside checkpoints). The atomic writes they use, and the lock that keeps one run per run directory,
are io/'s.

May import: plan/ (the cursor a checkpoint records), io/, config.py, exits.py.
"""
