"""bench.learning: drafters trained on the same batches of cached features learn a learnable corpus, and
the held-out acceptance it reports is the drafted block's accepted prefix."""
import json

import numpy as np
import pytest
import torch

from dflash_dist.bench import learning
from dflash_dist.data.disk import write_dataset

VOCAB = 64


def counting_corpus(n: int, length: int, seed: int):
    """Each sample counts up modulo VOCAB from a random start; the first 8 tokens are the prompt. A
    drafter that reads its anchor can draft the whole block."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tokens = (rng.integers(VOCAB) + np.arange(length)) % VOCAB
        mask = np.arange(length) >= 8
        yield tokens.astype(np.int64), mask.astype(np.uint8)


TINY = ["model.target.kind=tiny", f"model.target.vocab_size={VOCAB}", "objective.block_size=4",
        "objective.num_anchors=8", "plan.token_budget=256", "optim.lr=1e-2", "optim.warmup_ratio=0.05"]


def test_drafters_learn_and_acceptance_is_the_accepted_prefix(tmp_path, capsys):
    data = write_dataset(tmp_path / "ds", counting_corpus(120, 24, seed=0), vocab_size=VOCAB)
    out = tmp_path / "learning.json"
    learning.main(["--config", "", "--data", str(data), "--heldout", "20", "--sizes", "25,100", "--epochs", "6",
                   "--variants", "dflash,dflash2", "--eval-anchors", "12", "--json", str(out), *TINY, f"data.cache_dir={tmp_path / 'cache'}"])
    assert "tau~" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["samples"]) for r in rows] == [("dflash", 25), ("dflash2", 25), ("dflash", 100),
                                                            ("dflash2", 100)]
    for r in rows:
        assert 1.0 <= r["tau"] <= 4.0 and r["blocks"] == 20 * 12  # --eval-anchors 12 on each held-out sample
        # the accepted prefix is at most the run of correct slots: tau~ - 1 <= the slots' mean accuracy sum
        assert r["tau"] - 1.0 <= sum(r["acc"][1:]) + 1e-6
        # the served pick (the argmax, or the walk's) is one of the head's top-K: recall >= accuracy per slot
        assert all(t >= c - 1e-6 for t, c in zip(r["recall_top_k"], r["acc"]))
    small, big = rows[0], rows[2]
    assert big["steps"] > small["steps"] and big["tau"] > 3.0  # the counting rule, learned
    assert big["tau"] > small["tau"]
    # the features were captured once and cached
    assert len(list((tmp_path / "cache").glob("learning-features-*.pt"))) == 1


def test_bad_sizes_name_the_flag(tmp_path):
    data = write_dataset(tmp_path / "ds", counting_corpus(10, 24, seed=0), vocab_size=VOCAB)
    with pytest.raises(SystemExit):
        learning.main(["--config", "", "--data", str(data), "--heldout", "4", "--sizes", "7", *TINY])


def test_every_family_variant_learns_on_the_same_batches_and_is_read_by_distance(tmp_path, capsys):
    """DSpark and Domino (anchor as first: slot k drafts anchor + k + 1) and DFlash with target_full labels
    train on the same cached features (the final hidden state captured once, beside the layers); their
    figures are by the drafted token's distance from the anchor, as DFlash's. Those trained on the data
    learn the counting rule; DSpark (0.9 of its loss) and target_full learn the tiny target's random
    distribution instead, which is not the corpus's rule here (on regenerated replies the two agree)."""
    data = write_dataset(tmp_path / "ds", counting_corpus(120, 24, seed=0), vocab_size=VOCAB)
    out = tmp_path / "learning.json"
    variants = ["dflash", "dspark", "domino", "dflash+full"]
    learning.main(["--config", "", "--data", str(data), "--heldout", "20", "--sizes", "100", "--epochs", "6",
                   "--variants", ",".join(variants), "--eval-anchors", "12", "--json", str(out), *TINY,
                   "variant.markov_rank=16", "variant.gru_hidden_dim=32", "variant.emb_dim=16",
                   f"data.cache_dir={tmp_path / 'cache'}"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants
    for name, r in rows.items():
        drafts = 4 if name == "dspark" else 3  # B drafts a block (DSpark), or B - 1 (Domino as SGLang serves it)
        assert len(r["acc"]) == drafts + 1 and r["acc"][0] == 0.0 and r["blocks"] == 20 * 12, name
        assert r["tau"] - 1.0 <= sum(r["acc"][1:]) + 1e-6 and r["tau"] <= drafts + 1, name
        # tau~ is the mean of every block's accepted length, its standard error theirs
        runs = torch.tensor(r["accepted"])
        assert len(runs) == r["blocks"] and r["tau"] == pytest.approx(float(runs.mean()))
        assert r["tau_se"] == pytest.approx(float(runs.std()) / len(runs) ** 0.5) and r["tau_se"] > 0, name
    # the paired standard error of two variants' difference, over the same blocks
    a, b = rows["domino"]["accepted"], rows["dflash"]["accepted"]
    d = torch.tensor(a) - torch.tensor(b)
    assert learning.paired_se(a, b) == pytest.approx(float(d.std()) / len(d) ** 0.5) and float(d.std()) > 0
    for name in ("dflash", "domino"):
        assert rows[name]["tau"] > 3.0, (name, rows[name]["tau"])  # the counting rule, learned
    assert len(list((tmp_path / "cache").glob("learning-features-*.pt"))) == 1
