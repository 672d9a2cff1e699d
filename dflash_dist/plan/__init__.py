"""The seed's subject: each epoch's batch plan (epochs.py: seeded shuffle and packing under the budgets,
skips counted by reason, counted, digested, rebuilt and broadcast by rank 0), the one schedule both roles
walk (schedule.py: steps, routes, tail, stop-vote boundaries) and the seeding rules (seeding.py).

May import: parallel/ (the layout routes come from), and what parallel/ may import.
"""
