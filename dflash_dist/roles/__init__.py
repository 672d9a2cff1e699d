"""The two loops a rank runs: drafter.py (receive features, train, checkpoint) and target.py (capture and
send), and rank 0's duties inside the drafter loop (reporter.py: monitor, sinks, tau, checkpoints and
export files, summary, advice; every other rank gets the do-nothing NullReporter).

May import: evaluation/, forecast/, training/, checkpoints/, plan/, parallel/, data/, models/, observe/,
runtime/, io/, config.py, exits.py.
"""
