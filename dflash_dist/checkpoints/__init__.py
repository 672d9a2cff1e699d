"""Durable state: the checkpoint store (store.py: atomic, checksummed saves, fallback to the newest valid
one, crash-safe pruning, what a resume checks), the run directory's lineage (lineage.py: roll-backs and
set-aside checkpoints), one run per run directory (runlock.py) and atomic file writes (files.py, which
every stage that writes a file uses).

May import: config.py.
"""
