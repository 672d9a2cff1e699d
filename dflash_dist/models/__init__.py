"""Models: the tiny Qwen3-style target and its blocks (qwen3.py), packed attention paths (attention.py),
the DFlash drafter (drafter.py), transformers targets with tensor parallel and MoE (hf_target.py), a
drafter rank's head-only target (head.py), building either from the config (build.py), greedy decoding by
the target (decode.py) and the z-lab export with its model card (export.py).

May import: io/ (the exports' atomic writes), config.py, exits.py: every stage above builds on it.

Importing any module of models/ imports the variant registry first (below): it adds the variants' rules
to `config.validate`, so a config loaded by a process that builds a drafter is checked by its variant.
"""
from dflash_dist.models import variants  # noqa: F401  (registers the variants' config rules)
