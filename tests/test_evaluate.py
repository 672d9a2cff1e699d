"""Speculative decoding: output equals the target's greedy output; tau follows what the drafter gets right."""
from __future__ import annotations

import json

import pytest
import numpy as np
import torch
from torch import nn

from dflash_dist.config import load_config
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.evaluate import (acceptance_length, greedy_generate, heldout_prompts, main,
                                  read_prompts, speculative_generate)
from dflash_dist.export import export_drafter
from dflash_dist.models.build import build_drafter, build_target, draft_spec

CPU = torch.device("cpu")



def setup(block_size: int = 16, draft_layers: int = 1):
    cfg = load_config(overrides=[f"objective.block_size={block_size}", f"model.draft.num_layers={draft_layers}"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    return cfg, target, spec


class Oracle(nn.Module):
    """The drafter's call interface; proposes the target's own greedy continuation (one-hot logits),
    optionally wrong at one slot. Also checks the context it is handed: exactly the target's
    features of the committed prefix."""

    def __init__(self, target, spec, wrong_slot: int | None = None):
        super().__init__()
        self.target, self.spec, self.wrong_slot = target, spec, wrong_slot
        self.calls = 0

    def forward(self, features, input_ids, cu_seqlens, position_ids, anchors, anchor_cu):
        self.calls += 1
        B, V = self.spec.block_size, self.spec.vocab_size
        assert anchors.numel() == 1 and cu_seqlens.tolist() == [0, input_ids.numel()]
        a = int(anchors[0])
        assert a == input_ids.numel() - 1 and torch.equal(position_ids, torch.arange(a + 1))
        ref, _ = self.target.capture(input_ids[:a], torch.tensor([0, a]), torch.arange(a),
                                     list(self.spec.target_layer_ids))
        torch.testing.assert_close(features[:a], ref, atol=1e-5, rtol=1e-5)
        cont = greedy_generate(self.target, input_ids.tolist(), B - 1)
        if self.wrong_slot is not None:
            cont[self.wrong_slot - 1] = (cont[self.wrong_slot - 1] + 1) % V
        logits = torch.zeros(1, B, V)
        logits[0, torch.arange(1, B), torch.tensor(cont)] = 1.0
        return logits


PROMPTS = [[3, 17, 42, 99, 5, 8, 60], [11, 2, 2, 7, 90, 31, 44, 12, 19, 64, 1, 77], [120]]


def test_oracle_reaches_block_size():
    _, target, spec = setup(block_size=8)
    oracle = Oracle(target, spec)
    for p in PROMPTS:
        out, acc = speculative_generate(target, oracle, p, max_new_tokens=1 + 3 * 8)
        assert out == greedy_generate(target, p, 1 + 3 * 8)
        assert acc == [8, 8, 8]  # B tokens per verify step: B-1 drafted and accepted, plus the bonus
    r = acceptance_length(target, oracle, PROMPTS, max_new_tokens=30, strict=True)
    assert r["tau"] == 8.0 and r["exact"] and r["num_prompts"] == 3


@pytest.mark.parametrize("wrong_slot", [1, 3, 7])
def test_first_wrong_slot_bounds_acceptance(wrong_slot):
    _, target, spec = setup(block_size=8)
    oracle = Oracle(target, spec, wrong_slot=wrong_slot)
    out, acc = speculative_generate(target, oracle, PROMPTS[1], max_new_tokens=14)
    assert out == greedy_generate(target, PROMPTS[1], 14)
    assert set(acc) == {wrong_slot}  # slots before the wrong one are accepted, then the target's bonus


def test_random_drafter_output_equals_greedy():
    cfg, target, spec = setup(block_size=16, draft_layers=2)
    drafter = build_drafter(spec, target, seed=0, device=CPU)
    r = acceptance_length(target, drafter, PROMPTS, max_new_tokens=24, strict=True)
    assert r["exact"] and r["mismatches"] == 0
    assert 1.0 <= r["tau"] <= 16.0 and r["num_steps"] >= 3 * 24 / 16
    assert all(t >= 1.0 for t in r["tau_per_prompt"])
    assert drafter.training  # restored


def test_heldout_prompts_are_new_and_from_the_corpus_rule():
    cfg = load_config(overrides=["data.synthetic.num_samples=200"])
    held = heldout_prompts(cfg, 20)
    train = synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)
    def prompt(i):  # the unsupervised prefix, up to the first supervised token
        tokens, mask = train.sample(i)
        return tuple(tokens[:int(np.flatnonzero(mask)[0])].tolist())
    seen = {prompt(i) for i in range(len(train))}
    assert 15 <= len(held) <= 20 and not any(tuple(p) in seen for p in held)
    assert all(0 <= t < cfg.model.target.vocab_size - 1 for p in held for t in p)


def test_cli_reports_tau(tmp_path, capsys):
    cfg, target, spec = setup(block_size=4)
    d = build_drafter(spec, target, seed=1, device=CPU)
    export_drafter(d.spec, d.state_dict(), tmp_path / "draft", dtype=torch.float32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n" + json.dumps({"input_ids": PROMPTS[1]}) + "\n")
    assert read_prompts(prompts) == PROMPTS[:2]
    rc = main(["--draft", str(tmp_path / "draft"), "--prompts", str(prompts), "--max-new-tokens", "6",
               "objective.block_size=4", "--strict"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["prompt", "set"]
    name, n, steps, tau, B, exact = lines[1].split()
    assert (name, n, B, exact) == ("p.jsonl", "2", "4", "yes") and 1.0 <= float(tau) <= 4.0
    # Default prompts: held-out synthetic ones.
    assert main(["--draft", str(tmp_path / "draft"), "--max-new-tokens", "4", "--num-prompts", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("synthetic-heldout")


def test_cli_rejects_a_drafter_of_another_target(tmp_path):
    cfg, target, spec = setup(block_size=4)
    d = build_drafter(spec, target, seed=1, device=CPU)
    export_drafter(d.spec, d.state_dict(), tmp_path / "draft", dtype=torch.float32)
    assert main(["--draft", str(tmp_path / "draft"), "model.target.vocab_size=96", "--max-new-tokens", "2"]) == 2
