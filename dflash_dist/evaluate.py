"""python -m dflash_dist.evaluate: the entry point of the evaluation (dflash_dist.evaluation; its
cli module documents the flags). The names below are what the training run and the tests import."""
from __future__ import annotations

import sys

from dflash_dist.evaluation.cli import main
from dflash_dist.evaluation.heldout import heldout_prompts, prompts_of
from dflash_dist.evaluation.hf_engine import SpeculativeMismatch
from dflash_dist.evaluation.loading import load_for_eval
from dflash_dist.evaluation.measure import acceptance_length, training_eval
from dflash_dist.evaluation.prompts import EvalInputError, read_prompt_file
from dflash_dist.evaluation.reference import greedy_generate, propose_block, speculative_generate

__all__ = ["main", "heldout_prompts", "prompts_of", "SpeculativeMismatch", "load_for_eval", "acceptance_length",
           "training_eval", "EvalInputError", "read_prompt_file", "greedy_generate", "propose_block",
           "speculative_generate"]

if __name__ == "__main__":
    sys.exit(main())
