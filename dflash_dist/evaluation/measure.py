"""tau as the training run measures it (rank 0, before and after training): the hf engine on one rank,
on the synthetic held-out set or, with `train.eval_bench`, on a prompt set of the user's."""
from __future__ import annotations

from typing import Sequence

from dflash_dist.evaluation.hf_engine import Options, decode_answer
from dflash_dist.evaluation.prompts import PromptSet
from dflash_dist.evaluation.results import Tally


def acceptance_length(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      strict: bool = False, proposer=None) -> dict:
    """tau over all verify steps of token-id prompts (fixed length, no stop token), with the check that
    speculative output == the target's greedy output (a mismatch is counted and logged: bf16 can flip a
    near-tie; strict=True raises SpeculativeMismatch instead)."""
    total, per_prompt = Tally(drafter.spec.step_tokens), []
    was_training = drafter.training
    drafter.eval()
    try:
        for i, p in enumerate(prompts):
            t, _ = decode_answer(target, drafter, list(p), frozenset(), Options(max_new_tokens, strict, proposer), f"prompt {i}")
            t.num_prompts = 1
            per_prompt.append(1.0 + sum(t.accepted_per_position) / t.num_steps if t.num_steps else 0.0)
            total.merge(t)
    finally:
        drafter.train(was_training)
    r = total.to_json()
    r.update(tau_per_prompt=per_prompt, block_size=drafter.spec.block_size)
    return r


def set_tau(target, drafter, pset: PromptSet, chat, max_new_tokens: int) -> dict:
    """The same figures for a prompt set of any kind (conversations through `chat`)."""
    from dflash_dist.evaluation.hf_engine import run_sets
    was_training = drafter.training
    drafter.eval()
    try:
        tally = run_sets(target, drafter, [pset], chat, Options(max_new_tokens))[pset.name]
    finally:
        drafter.train(was_training)
    r = tally.to_json()
    r["block_size"] = drafter.spec.block_size
    return r


def eval_bench_set(cfg, target):
    """(PromptSet, Chat or None) of `train.eval_bench`, checked against the target: a ConfigError naming the
    key when the run cannot use it. Cheap (no decoding): `train.build` can call it before any rank waits."""
    from dflash_dist.config import ConfigError
    from dflash_dist.evaluation.prompts import EvalInputError, default_bench_dir, load_bench
    try:
        pset = load_bench(cfg.train.eval_bench, default_bench_dir()).limit(cfg.train.eval_prompts)
        pset.check_vocab(target.vocab_size)
        if pset.kind != "turns":
            return pset, None
        if target.kind != "hf":
            raise EvalInputError(f"{pset.source}: conversation prompts need a transformers target with a "
                                 "tokenizer (model.target.kind=hf)")
        from dflash_dist.evaluation.chat import Chat
        return pset, Chat(cfg.model.target.path, thinking=False)
    except EvalInputError as exc:
        raise ConfigError(f"config key 'train.eval_bench': {exc}") from exc


def training_eval(cfg, target, drafter) -> dict:
    """What the run's summary records: on `train.eval_bench` when set (its first `train.eval_prompts`
    prompts), else on the synthetic held-out set; float per-prompt figures are left out."""
    from dflash_dist.evaluation.heldout import heldout_prompts
    if not cfg.train.eval_bench:
        r = acceptance_length(target, drafter, heldout_prompts(cfg, cfg.train.eval_prompts), cfg.train.eval_new_tokens)
        r["prompt_set"] = "synthetic-heldout"
        return r
    pset, chat = eval_bench_set(cfg, target)
    r = set_tau(target, drafter, pset, chat, cfg.train.eval_new_tokens)
    r["prompt_set"] = pset.name
    return r
