"""Evaluation of an exported drafter as the published numbers are made (see cli.py for the command):

  prompts.py       prompt sets: token-id files, {"turns": [...]} conversations, named public benchmarks
  heldout.py       the synthetic held-out set (the tiny job's default)
  chat.py          the target's chat template and stop tokens
  speculative.py   the KV-cached draft-then-verify decoder and target-only greedy (the hf engine)
  reference.py     the full-recompute decoder the cached one is tested against
  hf_engine.py     prompts and conversations through the hf engine, split over torchrun ranks
  vllm_engine.py   the export served by vLLM's DFlash speculative decoding, figures from its metrics
  results.py       tau, acceptance per position, histogram, speedup; table and JSON
  loading.py       the export and its target, defects named by file
  measure.py       the end-of-training tau (dflash_dist.roles.reporter)

May import: data/ (chat rendering, held-out sets), models/, observe/, io/, config.py, exits.py.
"""
