"""What a training step is made of: the target's feature capture (capture.py), one drafter batch's
forward and backward in anchor chunks (step.py), the DFlash objective (objective.py: anchors, block
labels, the chunked LM-head loss, metrics), what drafters all-reduce (stats.py), the training state a
checkpoint holds (state.py) and what a role receives at start (setup.py).

May import: checkpoints/, plan/, parallel/, data/, models/, observe/, runtime/, io/, config.py, exits.py.
"""
