"""Models: the tiny Qwen3-style target and its blocks (qwen3.py), packed attention paths (attention.py),
the DFlash drafter (drafter.py), transformers targets with tensor parallel and MoE (hf_target.py), a
drafter rank's head-only target (head.py), building either from the config (build.py), greedy decoding by
the target (decode.py) and the z-lab export with its model card (export.py).

May import: io/ (the exports' atomic writes), config.py, exits.py: every stage above builds on it.
"""
