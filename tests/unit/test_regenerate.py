"""Regenerated responses: the target's own greedy continuation, KV-cached, equal to full recompute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_dist.config import load_config
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.data.target_corpus import cached_regenerate, regenerate_responses, regeneration_key, split_samples
from dflash_dist.evaluate import greedy_generate
from dflash_dist.models.build import build_target
from dflash_dist.models.decode import greedy as batched_greedy
from dflash_dist.models.decode import recompute_greedy, tiny_greedy

CPU = torch.device("cpu")



@pytest.fixture(scope="module")
def target():
    return build_target(load_config(), CPU)


def small_corpus(n=24):
    cfg = load_config(overrides=[f"data.synthetic.num_samples={n}", "data.synthetic.min_len=10",
                                 "data.synthetic.max_len=40"])
    return cfg, synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)


def teacher_forced_greedy(target, tokens, prompt_len: int) -> list[int]:
    """The target's greedy choice after every prefix of `tokens` that ends at or after the prompt, from
    one causal forward: equal to tokens[prompt_len:] exactly when they are its greedy continuation."""
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    _, logits = target.capture(t, torch.tensor([0, len(t)]), torch.arange(len(t)), [0], need_logits=True)
    return logits[prompt_len - 1:len(t) - 1].argmax(-1).tolist()


def test_kv_cached_greedy_equals_full_recompute(target):
    gen = torch.Generator().manual_seed(3)
    lengths, counts = [5, 17, 9, 17, 1, 30], [12, 3, 20, 0, 7, 9]
    prompts = [torch.randint(0, 127, (n,), generator=gen) for n in lengths]
    got = tiny_greedy(target, prompts, counts)
    for p, c, g in zip(prompts, counts, got):
        assert g.tolist() == greedy_generate(target, p.tolist(), c)
    # The generic paths agree too: packed recompute (equal lengths) and the per-length grouping.
    same = torch.stack([prompts[1], prompts[3]])
    cached = torch.stack(tiny_greedy(target, list(same), [5, 5]))
    assert torch.equal(recompute_greedy(target, same, 5), cached)


def test_regenerate_keeps_prompts_and_replaces_responses(target):
    _, ds = small_corpus()
    new = regenerate_responses(target, ds, batch_size=7)  # several batches, ragged prompts in each
    plen, rlen = split_samples(ds)
    assert len(new) == len(ds) and np.array_equal(new.lengths, ds.lengths)
    assert np.array_equal(split_samples(new)[0], plen) and new.vocab_size == ds.vocab_size
    changed = 0
    for i in range(len(ds)):
        old_tok, old_mask = ds.sample(i)
        tok, mask = new.sample(i)
        p = int(plen[i])
        assert np.array_equal(tok[:p], old_tok[:p])
        assert mask[:p].sum() == 0 and mask[p:].all() and mask.dtype == np.uint8
        assert tok[p:].tolist() == teacher_forced_greedy(target, tok, p)
        changed += not np.array_equal(tok[p:], old_tok[p:])
    assert changed == len(ds)  # the random target does not follow the corpus rule


def test_limits_and_unusual_samples(target):
    # sample 0: supervised from its first token (no prompt: kept); 1: nothing supervised (kept);
    # 2: interleaved mask (all from the first supervised token on is regenerated); 3: plain.
    toks = [np.arange(5), np.arange(10, 16), np.arange(20, 30), np.arange(40, 52)]
    masks = [np.ones(5), np.zeros(6), np.r_[0, 0, 1, 1, 0, 0, 1, 1, 1, 1], np.r_[np.zeros(4), np.ones(8)]]
    offsets = np.r_[0, np.cumsum([len(t) for t in toks])]
    ds = TokenDataset(np.concatenate(toks).astype(np.int64), offsets, np.concatenate(masks).astype(np.uint8), 128)
    new = regenerate_responses(target, ds, max_new_tokens=5)
    assert np.array_equal(new.sample(0)[0], toks[0]) and np.array_equal(new.sample(1)[0], toks[1])
    assert np.array_equal(new.sample(0)[1], masks[0]) and new.sample(1)[1].sum() == 0
    assert new.sample(2)[0].tolist() == [20, 21] + greedy_generate(target, [20, 21], 5)
    assert new.sample(3)[0].tolist() == list(range(40, 44)) + greedy_generate(target, list(range(40, 44)), 5)
    assert new.sample(3)[1].tolist() == [0] * 4 + [1] * 5
    # An end-of-sequence token ends the response (kept, supervised).
    cont = greedy_generate(target, list(range(40, 44)), 5)
    eos = cont[2]
    cut = regenerate_responses(target, ds, max_new_tokens=5, eos_token_id=eos).sample(3)[0].tolist()
    assert cut == list(range(40, 44)) + cont[:cont.index(eos) + 1]


def test_cache_hit_returns_equal_arrays(tmp_path, target):
    cfg, ds = small_corpus(12)
    key = regeneration_key(cfg, CPU)
    calls = []

    def fn():
        calls.append(1)
        return regenerate_responses(target, ds)

    first = cached_regenerate(tmp_path, key, fn)
    second = cached_regenerate(tmp_path, key, fn)
    assert len(calls) == 1 and len(list(tmp_path.glob("regen-*.npz"))) == 1
    for name in ("tokens", "offsets", "loss_mask"):
        assert np.array_equal(getattr(first, name), getattr(second, name))
        assert getattr(first, name).dtype == getattr(second, name).dtype
    assert first.vocab_size == second.vocab_size
    # Another corpus setting is another key.
    other = regeneration_key(load_config(overrides=["data.synthetic.seed=8"]), CPU)
    assert other != key
    cached_regenerate(tmp_path, other, fn)
    assert len(calls) == 2 and len(list(tmp_path.glob("regen-*.npz"))) == 2


def test_default_corpus_regenerates_fast_enough(target):
    """The default job's corpus (1200 samples) must not dominate a CPU run."""
    import time
    cfg = load_config()
    ds = synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)
    t0 = time.process_time()
    new = regenerate_responses(target, ds)
    spent = time.process_time() - t0
    assert np.array_equal(new.lengths, ds.lengths) and spent < 60, spent
    plen, _ = split_samples(ds)
    for i in range(0, len(ds), 97):
        assert new.sample(i)[0][plen[i]:].tolist() == teacher_forced_greedy(target, new.sample(i)[0], plen[i])


def test_batched_greedy_falls_back_to_capture():
    """A target with only `capture` (no KV cache of ours) still generates, one batch per prompt length."""
    tiny = build_target(load_config(), CPU)

    class CaptureOnly(torch.nn.Module):
        kind = "recompute"  # models.target: decoded by recomputing the sequence

        def __init__(self):
            super().__init__()
            self.inner = tiny
            self.embed_tokens, self.vocab_size = tiny.embed_tokens, tiny.vocab_size

        def capture(self, *a, **k):
            return self.inner.capture(*a, **k)

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([9, 8]), torch.tensor([4, 5, 6])]
    got = batched_greedy(CaptureOnly(), prompts, [4, 2, 0])
    assert [g.tolist() for g in got] == [greedy_generate(tiny, p.tolist(), c) for p, c in zip(prompts, [4, 2, 0])]


def test_cli_writes_a_prepared_dataset(tmp_path, target):
    from dflash_dist.data.disk import open_dataset
    from dflash_dist.data.regenerate import main
    over = ["data.synthetic.num_samples=10", "data.synthetic.min_len=10", "data.synthetic.max_len=30"]
    assert main(["--out", str(tmp_path / "regen"), *over]) == 0
    got = open_dataset(tmp_path / "regen")
    cfg = load_config(overrides=over)
    want = regenerate_responses(target, synthetic_dataset(cfg.data.synthetic, 128))
    assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.loss_mask, want.loss_mask)
    assert np.array_equal(got.offsets, want.offsets) and got.meta["regenerated_from"] == "synthetic"
    assert main(["--out", str(tmp_path / "regen"), *over]) == 2  # exists: refused without --overwrite


def test_help_shows_the_chat_options_and_names_the_token_corpus(capsys):
    """`regenerate --help` is the chat regeneration's (the one users run), and says where the token corpus's is."""
    from dflash_dist.data.regenerate import main

    def code(argv):
        try:
            return main(argv)
        except SystemExit as exc:
            return exc.code
    assert code(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--input" in out and "--on-length" in out and "--out x --help" in out
    assert code(["--out", "x", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out
