"""Text benchmarks on a tiny transformers target with a chat-template tokenizer made here: conversations
turn by turn through the template, answers ending at the end-of-turn token, the KV-cached decoder equal
to the full-recompute reference, and the end-of-training tau on `train.eval_bench`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_fixtures import make_tokenizer
from evaluate_fixtures import CPU, TURNS, make_export, target_overrides, write_jsonl

from dflash_dist.config import load_config
from dflash_dist.evaluate import main, speculative_generate, training_eval
from dflash_dist.evaluation.chat import Chat
from dflash_dist.evaluation.loading import load_for_eval
from dflash_dist.evaluation.speculative import speculative, target_greedy


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def loaded(exported):
    model_dir, draft = exported
    cfg = load_config(overrides=target_overrides(model_dir))
    return cfg, *load_for_eval(draft, cfg, CPU)


def test_cached_decoder_equals_full_recompute_on_a_transformers_target(loaded):
    cfg, target, drafter = loaded
    gen = torch.Generator().manual_seed(5)
    steps = []
    for n in (7, 12, 30):
        p = torch.randint(5, target.vocab_size, (n,), generator=gen).tolist()
        ref_out, ref_acc = speculative_generate(target, drafter, p, 40)
        out = speculative(target, drafter, p, 40)
        assert out.tokens == ref_out == target_greedy(target, p, 40).tokens
        assert out.tokens == target.greedy(torch.tensor([p]), 40)[0].tolist()  # transformers' own cached greedy
        assert out.accepted == ref_acc
        steps += out.accepted
    assert 1 in steps and 4 in steps  # the trained drafter is sometimes right, sometimes not


def test_answers_end_at_the_end_of_turn(loaded, exported):
    cfg, target, drafter = loaded
    chat = Chat(exported[0], thinking=False)
    # generation_config's EOS and the template's end-of-turn marker: where a regenerated reply ends too.
    eos = json.loads((Path(exported[0]) / "generation_config.json").read_text())["eos_token_id"]
    assert chat.stop == {eos, chat.tok.convert_tokens_to_ids("<|end|>")}
    ended = 0
    for conv in TURNS:
        messages = []
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn})
            ids = chat.render(messages, "test")
            assert chat.tok.decode(ids).endswith("<|assistant|>\n")
            full = target_greedy(target, ids, 60).tokens  # no stop: what the model would go on saying
            out = speculative(target, drafter, ids, 60, chat.stop)
            end = next((i + 1 for i, t in enumerate(full) if t in chat.stop), 60)
            assert out.tokens == full[:end]
            ended += end < 60
            messages.append({"role": "assistant", "content": chat.answer(out.tokens)})
    assert ended  # some answer really stopped early at the end-of-turn token


def test_thinking_switch_reaches_the_template(tmp_path):
    template = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>\n"
                "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    make_tokenizer(tmp_path, template)
    msgs = [{"role": "user", "content": "hi"}]
    on, off = Chat(tmp_path, thinking=True).render(msgs, "t"), Chat(tmp_path, thinking=False).render(msgs, "t")
    tok = Chat(tmp_path, thinking=True).tok
    assert tok.decode(on).endswith("<think>\n") and tok.decode(off).endswith("</think>\n\n")


def test_cli_text_and_token_sets_to_json(tmp_path, exported, capsys):
    model_dir, draft = exported
    turns = write_jsonl(tmp_path / "chat.jsonl", TURNS)
    ids = write_jsonl(tmp_path / "ids.jsonl", [[3, 17, 42, 99, 5, 8, 60], {"input_ids": [11, 22, 23, 7, 90, 31]}])
    out = tmp_path / "out.json"
    rc = main(["--draft", str(draft), "--bench", str(turns), "--bench", str(ids), "--engine", "hf", "--json", str(out),
               "--max-new-tokens", "40", "--strict", *target_overrides(model_dir)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["engine"] == "hf" and r["block_size"] == 4 and list(r["sets"]) == ["chat", "ids"]
    chat, tok = r["sets"]["chat"], r["sets"]["ids"]
    assert (chat["num_prompts"], chat["num_turns"]) == (3, 6) and (tok["num_prompts"], tok["num_turns"]) == (2, 2)
    assert tok["new_tokens"] == 80 and chat["new_tokens"] <= 6 * 40  # conversations stop at the end of turn
    for s in (chat, tok, r["overall"]):
        assert s["exact"] and s["num_steps"] > 0 and abs(sum(s["histogram"]) - 1) < 1e-9
        per_pos = s["accepted_per_position"]
        assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)  # acceptance is a prefix
        assert s["tau"] == pytest.approx(1 + sum(per_pos) / s["num_steps"])
        assert s["tokens_per_s"]["target"] > 0 and s["tokens_per_s"]["speculative"] > 0 and s["speedup"] > 0
    assert r["overall"]["num_steps"] == chat["num_steps"] + tok["num_steps"]
    assert sum(r["overall"]["accepted_per_position"]) > 0
    table = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in table[1:]] == ["chat", "ids", "overall"]


def test_training_eval_on_eval_bench(tmp_path, exported, loaded):
    model_dir, _ = exported
    _, target, drafter = loaded
    bench = write_jsonl(tmp_path / "mine.jsonl", TURNS)
    cfg = load_config(overrides=target_overrides(model_dir) + [f"train.eval_bench={bench}", "train.eval_prompts=2",
                                                               "train.eval_new_tokens=20"])
    r = training_eval(cfg, target, drafter)
    assert r["prompt_set"] == "mine" and r["num_prompts"] == 2 and r["num_turns"] == 3 and r["exact"]
    assert r["tau"] >= 1.0 and not drafter.training
    default = training_eval(load_config(overrides=target_overrides(model_dir) + ["train.eval_prompts=2"]),
                            target, drafter)
    assert default["prompt_set"] == "synthetic-heldout" and default["num_prompts"] <= 2
