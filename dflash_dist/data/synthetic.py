"""The embedded default corpus: seeded, structured token sequences that a drafter can learn.

Each sample is a prompt (unsupervised) followed by a response (supervised). Tokens follow a fixed
seeded successor table (token -> next token) except for a `noise` share drawn at random, so the next
16 tokens are partly predictable from the anchor and the context: the loss can fall within a short run.
The last vocabulary row is never produced, which leaves it free for the mask token.
"""
from __future__ import annotations

import numpy as np

from dflash_dist.config import SyntheticConfig
from dflash_dist.data.dataset import TokenDataset


def synthetic_dataset(cfg: SyntheticConfig, vocab_size: int) -> TokenDataset:
    rng = np.random.default_rng(cfg.seed)
    usable = vocab_size - 1
    successor = rng.permutation(usable)
    lengths = rng.integers(cfg.min_len, cfg.max_len + 1, size=cfg.num_samples)
    offsets = np.zeros(cfg.num_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    tokens = np.empty(total, dtype=np.int64)
    noise = rng.random(total) < cfg.noise
    random_tokens = rng.integers(0, usable, size=total)
    loss_mask = np.zeros(total, dtype=np.uint8)
    for i in range(cfg.num_samples):
        a, b = offsets[i], offsets[i + 1]
        tok = random_tokens[a]
        for p in range(a, b):
            if p > a:
                tok = random_tokens[p] if noise[p] else successor[tok]
            tokens[p] = tok
        loss_mask[a + int((b - a) * cfg.prompt_frac):b] = 1
    return TokenDataset(tokens=tokens, offsets=offsets, loss_mask=loss_mask, vocab_size=vocab_size)


def chat_lengths(n: int, token_budget: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, supervised counts) of the reference chat mix: the benchmarks' and the memory model's
    stand-in for a real dataset (see bench.plan for what it models)."""
    rng = np.random.default_rng(seed)
    short = rng.random(n) < 0.55
    lengths = np.where(short, rng.lognormal(np.log(900), 0.8, n), rng.lognormal(np.log(3000), 0.8, n))
    lengths = np.clip(lengths, 16, token_budget).astype(np.int64)
    supervised = (lengths * rng.uniform(0.5, 0.8, n)).astype(np.int64)
    over = rng.choice(n, size=max(1, n // 20_000), replace=False)  # prepared with a longer --max-length
    lengths[over] = rng.integers(token_budget + 1, 2 * token_budget, size=len(over))
    return lengths, supervised
