"""The synthetic held-out set: prompts the tiny job never trained on (the default prompt set)."""
from __future__ import annotations

import dataclasses

from dflash_dist.data.target_corpus import split_samples
from dflash_dist.evaluation.prompts import PromptSet


def heldout_prompts(cfg, n: int) -> list[list[int]]:
    """Prompts from the synthetic corpus's own distribution. The successor table depends on the seed
    alone, while a larger draw shifts the random stream, so the tail of a corpus of num_samples + n
    samples holds new sequences that follow the same rule. A prompt that happens to equal a training
    prompt (short and noise-free) is dropped."""
    from dflash_dist.data.synthetic import synthetic_dataset
    syn = cfg.data.synthetic
    vocab = cfg.model.target.vocab_size
    train_ds = synthetic_dataset(syn, vocab)
    seen = set(prompts_of(train_ds, range(len(train_ds))))
    ds = synthetic_dataset(dataclasses.replace(syn, num_samples=syn.num_samples + n), vocab)
    return [list(p) for p in prompts_of(ds, range(len(ds) - n, len(ds))) if p and p not in seen]


def prompts_of(ds, indices) -> list[tuple[int, ...]]:
    """The prompts (unsupervised prefixes) of the given samples."""
    plen, _ = split_samples(ds)
    return [tuple(ds.sample(i)[0][:plen[i]].tolist()) for i in indices]


def heldout_set(cfg, n: int) -> PromptSet:
    items = heldout_prompts(cfg, n)
    return PromptSet("synthetic-heldout", "synthetic held-out set", "ids", items, list(range(1, len(items) + 1)))
