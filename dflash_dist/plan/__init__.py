"""The seed's subject: each epoch's batch plan (epochs.py: seeded shuffle and packing under the budgets,
skips counted by reason, counted, digested, rebuilt and broadcast by rank 0), the one schedule both roles
walk (schedule.py: steps, routes, tail, stop-vote boundaries, and Cursor: a run's position in the plan,
which checkpoints record), the seeding rules (seeding.py) and the long samples weighed at a run's start
(long_samples.py: the share skipped, the target's context, truncation).

May import: parallel/ (the layout routes come from), data/, models/, observe/, io/, config.py, exits.py.
"""
