"""Speculative decoding on the built-in target: the KV-cached decoder equals the full-recompute reference
(output and every step's acceptance) and the target's greedy output; tau follows what the drafter gets
right; the figures reported; the command line on token-id prompts."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from oracles import FeatureDrafter, propose_with_logits
from torch import nn

from dflash_dist.config import load_config
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.evaluate import acceptance_length, greedy_generate, heldout_prompts, main, speculative_generate
from dflash_dist.evaluation.prompts import read_prompt_file
from dflash_dist.evaluation.results import Tally, answer_digest, report, table
from dflash_dist.evaluation.speculative import speculative, target_greedy
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.export import export_drafter

CPU = torch.device("cpu")


def setup(block_size: int = 16, draft_layers: int = 1):
    cfg = load_config(overrides=[f"objective.block_size={block_size}", f"model.draft.num_layers={draft_layers}"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    return cfg, target, spec


class Oracle(nn.Module):
    """The drafter's evaluation interface (`block_logits`); proposes the target's own greedy continuation (one-hot logits),
    optionally wrong at one slot. Also checks the context it is handed: exactly the target's
    features of the committed prefix (from the KV cache too, where the cached decoder runs it)."""

    def __init__(self, target, spec, wrong_slot: int | None = None):
        super().__init__()
        self.target, self.spec, self.wrong_slot = target, spec, wrong_slot
        self.calls = 0

    def block_logits(self, features, input_ids, cu_seqlens, position_ids, anchors, anchor_cu):
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


def decode(decoder, target, oracle, prompt, n):
    """(tokens, steps) of an oracle by either decoder (the oracle's proposers: tests/oracles.py)."""
    if decoder == "reference":
        return speculative_generate(target, oracle, prompt, n, propose=propose_with_logits)
    out = speculative(target, oracle, prompt, n, proposer=FeatureDrafter)
    return out.tokens, out.accepted


@pytest.mark.parametrize("decoder", ["reference", "cached"])
def test_oracle_reaches_block_size(decoder):
    _, target, spec = setup(block_size=8)
    oracle = Oracle(target, spec)
    for p in PROMPTS:
        out, acc = decode(decoder, target, oracle, p, 1 + 3 * 8)
        assert out == greedy_generate(target, p, 1 + 3 * 8)
        assert acc == [8, 8, 8]  # B tokens per verify step: B-1 drafted and accepted, plus the bonus
    r = acceptance_length(target, oracle, PROMPTS, max_new_tokens=30, strict=True, proposer=FeatureDrafter)
    assert r["tau"] == 8.0 and r["exact"] and r["num_prompts"] == 3
    assert r["accepted_per_position"] == [r["num_steps"]] * 7 and r["histogram"][-1] == 1.0


@pytest.mark.parametrize("decoder", ["reference", "cached"])
@pytest.mark.parametrize("wrong_slot", [1, 3, 7])
def test_first_wrong_slot_bounds_acceptance(wrong_slot, decoder):
    _, target, spec = setup(block_size=8)
    oracle = Oracle(target, spec, wrong_slot=wrong_slot)
    out, acc = decode(decoder, target, oracle, PROMPTS[1], 14)
    assert out == greedy_generate(target, PROMPTS[1], 14)
    assert set(acc) == {wrong_slot}  # slots before the wrong one are accepted, then the target's bonus


def test_cached_decoder_equals_full_recompute_step_for_step():
    """A real drafter (the context-caching path), several block sizes: same tokens, same acceptance."""
    for B in (4, 16):
        _, target, spec = setup(block_size=B, draft_layers=2)
        drafter = build_drafter(spec, target, seed=3, device=CPU).eval()
        for p in PROMPTS + [list(range(1, 60))]:
            ref_out, ref_acc = speculative_generate(target, drafter, p, 33)
            out = speculative(target, drafter, p, 33)
            assert out.tokens == ref_out == target_greedy(target, p, 33).tokens
            assert out.accepted == ref_acc
            assert speculative(target, drafter, p, 33, recompute=True).accepted == ref_acc


def test_a_stop_token_ends_the_answer_and_its_step_counts_whole():
    _, target, spec = setup(block_size=8)
    oracle = Oracle(target, spec)
    full = greedy_generate(target, PROMPTS[0], 30)
    stop = frozenset({full[10]})
    end = full.index(full[10]) + 1
    out = speculative(target, oracle, PROMPTS[0], 30, stop, proposer=FeatureDrafter)
    assert out.tokens == full[:end] == target_greedy(target, PROMPTS[0], 30, stop).tokens
    assert sum(out.accepted) >= end and out.accepted[-1] == 8  # the last step accepted its block whole


def test_random_drafter_output_equals_greedy():
    cfg, target, spec = setup(block_size=16, draft_layers=2)
    drafter = build_drafter(spec, target, seed=0, device=CPU)
    r = acceptance_length(target, drafter, PROMPTS, max_new_tokens=24, strict=True)
    assert r["exact"] and r["mismatches"] == 0
    assert 1.0 <= r["tau"] <= 16.0 and r["num_steps"] >= 3 * 24 / 16
    assert all(t >= 1.0 for t in r["tau_per_prompt"])
    assert drafter.training  # restored


def test_tally_figures_follow_the_steps():
    t = Tally(4, num_prompts=2, num_turns=3, new_tokens=14, target_s=3.0, speculative_s=1.5)
    t.add_steps([1, 4, 2])
    t.add_steps([3, 4])
    r = report("hf", 4, {"a": t, "b": Tally(4)})
    a = r["sets"]["a"]
    assert a["tau"] == pytest.approx(14 / 5) and a["accepted_per_position"] == [4, 3, 2]
    assert a["histogram"] == pytest.approx([0.2, 0.2, 0.2, 0.4]) and a["speedup"] == 2.0
    assert a["tokens_per_s"] == {"target": 14 / 3.0, "speculative": 14 / 1.5}
    assert r["sets"]["b"]["tau"] == 0.0 and r["sets"]["b"]["speedup"] is None
    assert r["overall"]["accepted_per_position"] == [4, 3, 2] and r["overall"]["num_prompts"] == 2


def test_output_digest_is_the_answers_in_order():
    """Equal answers in the same order give one digest however the tallies were split and merged."""
    answers = [[1, 2, 3], [4], [5, 6]]
    whole = Tally(4, answer_digests=[answer_digest(a) for a in answers])
    parts = Tally(4)
    for a in answers:
        parts.merge(Tally(4, answer_digests=[answer_digest(a)]))
    assert parts.to_json()["output_digest"] == whole.to_json()["output_digest"]
    other = Tally(4, answer_digests=[answer_digest(a) for a in ([1, 2, 3], [4], [5, 7])])
    swapped = Tally(4, answer_digests=[answer_digest(a) for a in reversed(answers)])
    assert len({t.to_json()["output_digest"] for t in (whole, other, swapped)}) == 3


def test_baselines_sit_beside_the_drafter_in_json_and_table():
    def tally(steps, accepted, new, seconds, proposals):
        t = Tally(4, num_prompts=2, num_turns=2, num_steps=steps, accepted_per_position=accepted, new_tokens=new,
                  target_s=8.0, speculative_s=seconds, proposal_steps=proposals)
        return {"a": t}
    # target: 30 tokens in 28 steps (one per answer from its prefill); ngram: 12 steps, 4 of them proposing.
    r = report("vllm", 4, tally(10, [9, 6, 3], 30, 2.0, 10),
               {"target": tally(28, [0, 0, 0], 30, 8.0, 0), "ngram": tally(12, [4, 2, 0], 30, 5.0, 4)})
    b = r["baselines"]
    assert b["target"]["sets"]["a"]["tau"] == 1.0 and b["target"]["overall"]["num_steps"] == 28
    assert b["ngram"]["sets"]["a"]["tau"] == pytest.approx(1 + 6 / 12) and b["ngram"]["sets"]["a"]["proposal_steps"] == 4
    assert b["ngram"]["overall"]["tokens_per_s"]["speculative"] == 30 / 5.0 and r["sets"]["a"]["tau"] == 2.8
    lines = table(r).splitlines()
    head = lines.index("") + 1
    assert lines[head].split()[:4] == ["prompt", "set", "decoder", "steps"]
    rows = [ln.split() for ln in lines[head + 1:]]
    assert [(x[0], x[1]) for x in rows] == [(s, d) for s in ("a", "overall") for d in ("dflash", "target", "ngram")]
    assert rows[1][2:6] == ["28", "30", "1.000", "3.8"] and rows[2][2:6] == ["12", "30", "1.500", "6.0"]
    assert rows[0][2:6] == ["10", "30", "2.800", "15.0"]
    assert "" not in table(report("vllm", 4, tally(10, [9, 6, 3], 30, 2.0, 10))).splitlines()  # no baselines: one table


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


def test_cli_reports_tau_table_and_json(tmp_path, capsys):
    cfg, target, spec = setup(block_size=4)
    d = build_drafter(spec, target, seed=1, device=CPU)
    export_drafter(d.spec, d.state_dict(), tmp_path / "draft", dtype=torch.float32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n\n" + json.dumps({"input_ids": PROMPTS[1]}) + "\n")
    assert read_prompt_file(prompts).items == PROMPTS[:2]
    rc = main(["--draft", str(tmp_path / "draft"), "--prompts", str(prompts), "--max-new-tokens", "6",
               "objective.block_size=4", "--strict", "--json", str(tmp_path / "out.json")])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["prompt", "set"]
    name, n, turns, steps, tau, B, speedup, per_pos, exact = lines[1].split()
    assert (name, n, turns, B, exact) == ("p", "2", "2", "4", "yes") and 1.0 <= float(tau) <= 4.0
    out = json.loads((tmp_path / "out.json").read_text())
    r = out["sets"]["p"]
    assert out["engine"] == "hf" and out["block_size"] == 4 and out["overall"]["num_steps"] == r["num_steps"]
    assert r["new_tokens"] == 12 and r["exact"] and len(r["accepted_per_position"]) == 3 and len(r["histogram"]) == 4
    assert r["tau"] == pytest.approx(1 + sum(r["accepted_per_position"]) / r["num_steps"])
    assert per_pos == "/".join(map(str, r["accepted_per_position"])) and r["speedup"] > 0
    assert set(r["tokens_per_s"]) == {"target", "speculative"}
    # Default prompts: held-out synthetic ones.
    assert main(["--draft", str(tmp_path / "draft"), "--max-new-tokens", "4", "--num-prompts", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("synthetic-heldout")


def test_eval_bench_errors_name_the_key(tmp_path):
    from dflash_dist.config import ConfigError
    from dflash_dist.evaluate import training_eval
    cfg, target, spec = setup(block_size=4)
    drafter = build_drafter(spec, target, seed=0, device=CPU)
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"turns": ["hi"]}\n')
    with pytest.raises(ConfigError, match=r"'train.eval_bench': .*chat.jsonl: conversation prompts need a transformers"):
        training_eval(load_config(overrides=[f"train.eval_bench={chat}", "objective.block_size=4"]), target, drafter)
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[1, 2, 3]\n[4, 5, 6, 7]\n[8]\n")
    r = training_eval(load_config(overrides=[f"train.eval_bench={ids}", "train.eval_prompts=2",
                                             "train.eval_new_tokens=6", "objective.block_size=4"]), target, drafter)
    assert r["prompt_set"] == "ids" and r["num_prompts"] == 2 and r["new_tokens"] == 12 and r["exact"]


def test_bench_evaluate_smoke(tmp_path):
    """The benchmark's own check at a small size: both decoders and greedy agree; JSON written."""
    from dflash_dist.bench.evaluate import main as bench
    bench(["--prompt-len", "24", "--new-tokens", "10", "--reps", "1", "--json", str(tmp_path / "b.json")])
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["equal"] for r in rows] == [True, True] and all(r["seconds"]["cached"] > 0 for r in rows)
