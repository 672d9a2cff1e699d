"""Durable state: the checkpoint store (store.py: atomic, checksummed saves, fallback to the newest valid
one, crash-safe pruning, what a resume checks), the run directory's lineage (lineage.py: roll-backs and
set-aside checkpoints), one run per run directory (runlock.py) and the atomic file and directory writes
(files.py: atomic_write, AtomicDir and their one temporary-name rule, which every stage that writes uses;
models/, below this layer, keeps its own).

May import: config.py.
"""
