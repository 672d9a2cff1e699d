"""Issue 44, prepare's side: a user's own chat data trained as the target writes it, with a real tokenizer
whose Qwen3-style ChatML template handles thinking and tools (chat_fixtures.CHATML_TEMPLATE): reasoning
of every turn, tool calls supervised and tool results not, the served template arguments, weight-0 turns,
mixtures, the held-out split and duplicates, the target's context, pre-tokenized rows."""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import pytest
from chat_fixtures import CHATML_EOT, CONV, make_chatml_tokenizer, make_tokenizer, openai, write_jsonl

from dflash_dist.data.disk import open_dataset
from dflash_dist.data.jsonl import read_record
from dflash_dist.data.mixture import Selection, SourceError, parse_source
from dflash_dist.data.prepare import InputError, Options, conversation_samples, load_tokenizer, main, prepare
from dflash_dist.data.prepare_args import max_length, options, parser
from dflash_dist.data.render import end_of_turn_marker
from dflash_dist.evaluation.prompts import read_prompt_file

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def supervised_text(tok, ids, mask) -> str:
    return tok.decode(np.asarray(ids)[np.asarray(mask) == 1].tolist())


def samples(tok, record: dict, opts: Options = Options()):
    return conversation_samples(tok, read_record(json.dumps(record)), opts, end_of_turn_marker(tok))


def thinking_corpus() -> list[dict]:
    """Two-turn conversations, reasoning under reasoning_content, `reasoning` (vLLM's field), `thinking`,
    and inline <think> blocks (what data.regenerate writes for a thinking target)."""
    return [
        {"messages": [{"role": "user", "content": "What is 2+2?"},
                      {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
                      {"role": "user", "content": "And 3+3?"},
                      {"role": "assistant", "content": "6.", "reasoning": "Three plus three is six."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "<think>\nFrance: Paris.\n</think>\n\nParis."},
                      {"role": "user", "content": "Of Italy?"},
                      {"role": "assistant", "content": "<think>\nItaly: Rome.\n</think>\n\nRome."}]},
        {"conversations": [{"from": "human", "value": "Say hi."},
                           {"from": "gpt", "value": "Hi!", "thinking": "A greeting back."},
                           {"from": "human", "value": "Say bye."},
                           {"from": "gpt", "value": "Bye!", "thinking": "A farewell."}]},
    ]


REASONINGS = ["Two plus two is four.", "Three plus three is six.", "France: Paris.", "Italy: Rome.",
              "A greeting back.", "A farewell."]


def test_every_turns_reasoning_is_supervised_in_some_sample(chatml):
    tok = load_tokenizer(str(chatml))
    texts, notes = [], {}
    for record in thinking_corpus():
        kept = samples(tok, record)
        assert len(kept.samples) == 2  # the template drops turn 1's reasoning once turn 2 follows
        texts += [supervised_text(tok, ids, mask) for ids, mask in kept.samples]
        for k, v in kept.notes.items():
            notes[k] = notes.get(k, 0) + v
    for reasoning in REASONINGS:
        assert any(reasoning in t for t in texts), reasoning
    assert notes["reasoning_turns"] == 6 and notes.get("reasoning_left_out", 0) == 0
    # Every reasoning character is a supervised token (a character-level tokenizer: one token each).
    assert notes["reasoning_tokens"] == sum(len(r) for r in REASONINGS)
    # Each sample supervises its turn's answer and end of turn, and each answer is trained once.
    joined = "".join(texts)
    for answer in ("4.", "6.", "Paris.", "Rome.", "Hi!", "Bye!"):
        assert joined.count(answer + CHATML_EOT) == 1


def test_reasoning_left_out_is_counted_and_named_by_line(chatml, tmp_path, caplog):
    src = write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in thinking_corpus()])
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(chatml), str(src), str(tmp_path / "ds"), Options(split_turns=False))
    assert meta["replies"]["reasoning_left_out"] == 3 and meta["num_samples"] == 3
    assert "t.jsonl:2: the sample ending at message 4: the chat template left out the reasoning" in caplog.text
    full = prepare(str(chatml), str(src), str(tmp_path / "ds2"), Options())
    assert full["replies"]["reasoning_left_out"] == 0 and full["num_samples"] == 6
    assert full["replies"]["reasoning_tokens"] == sum(len(r) for r in REASONINGS)
    assert full["read"]["reasoning_field:reasoning"] == 1 and full["read"]["reasoning_field:thinking"] == 2


def test_one_sample_loses_the_first_turns_reasoning_and_counts_it(chatml):
    tok = load_tokenizer(str(chatml))
    kept = samples(tok, thinking_corpus()[0], Options(split_turns=False))
    assert len(kept.samples) == 1
    text = supervised_text(tok, *kept.samples[0])
    assert "Two plus two" not in text and "Three plus three is six." in text
    assert kept.notes["reasoning_left_out"] == 1 and kept.notes["reasoning_turns"] == 2


def test_a_verbatim_template_keeps_one_sample(tmp_path):
    tok = load_tokenizer(str(make_tokenizer(tmp_path / "tok")))
    kept = samples(tok, openai(CONV))
    assert len(kept.samples) == 1 and "split_conversations" not in kept.notes


def tool_record() -> dict:
    return {"tools": json.dumps(TOOLS), "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "SUNNY-25C"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "RAINY-12C"},
        {"role": "assistant", "content": "Let me also check Oslo.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c3", "name": "get_weather", "content": "SNOWY-MINUS3C"},
        {"role": "assistant", "content": "Paris sunny, Rome rainy, Oslo snowy."}]}


def test_tool_calls_are_supervised_and_tool_results_are_not(chatml):
    tok = load_tokenizer(str(chatml))
    kept = samples(tok, tool_record())
    # As Qwen3's, the template writes an empty think block before the last turn only: each call turn is
    # rendered as the target wrote it in a sample of its own.
    assert len(kept.samples) == 3
    full = "".join(tok.decode(ids.tolist()) for ids, _ in kept.samples)
    sup = "".join(supervised_text(tok, ids, mask) for ids, mask in kept.samples)
    for city in ("Paris", "Rome", "Oslo"):
        call = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
        assert sup.count(call) == 1, city  # supervised once, in its turn's sample
    assert "Let me also check Oslo.\n<tool_call>" in sup
    assert sup.count("Paris sunny, Rome rainy, Oslo snowy." + CHATML_EOT) == 1
    for result in ("SUNNY-25C", "RAINY-12C", "SNOWY-MINUS3C"):
        assert result in full and result not in sup
    assert '"description": "the weather of a city"' in full and "description" not in sup  # the tools: prompt
    assert kept.notes["tool_call_turns"] == 2


def test_a_template_that_drops_tool_calls_trains_no_empty_call_turn(tmp_path, caplog):
    """A template without tools (the plain one here, SmolLM2's in the wild) writes the call turn empty: its
    end-of-turn marker alone would teach the drafter that the turn ends where the target writes its call.
    That turn is not trained, and it is counted and named."""
    tok = load_tokenizer(str(make_tokenizer(tmp_path / "tok")))
    record = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "add two and two."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "it is four."}]}
    kept = samples(tok, record)
    sup = "".join(supervised_text(tok, ids, mask) for ids, mask in kept.samples)
    assert sup == "it is four.<|end|>"  # not "<|end|>it is four.<|end|>"
    assert kept.notes["tool_calls_not_rendered"] == 1 and kept.notes["tool_call_turns"] == 1
    assert any("did not write the tool calls" in why for why in kept.left_out)
    src = write_jsonl(tmp_path / "calls.jsonl", [json.dumps(record)])
    with caplog.at_level(logging.WARNING):
        meta = prepare(str(tmp_path / "tok"), str(src), str(tmp_path / "out"), Options())
    assert meta["replies"]["tool_calls_not_rendered"] == 1
    assert any(f"{src}:1" in r.getMessage() for r in caplog.records)


def test_thinking_off_reply_is_supervised_from_its_first_written_token(chatml):
    tok = load_tokenizer(str(chatml))
    record = openai([("user", "Hi?"), ("assistant", "Hello."), ("user", "Bye?"), ("assistant", "Goodbye.")])
    off = samples(tok, record, Options(template_kwargs={"enable_thinking": False}))
    texts = [supervised_text(tok, ids, mask) for ids, mask in off.samples]
    assert texts == ["Hello." + CHATML_EOT, "Goodbye." + CHATML_EOT]
    for ids, mask in off.samples:  # the empty think block is the served prompt: there, unsupervised
        assert "<think>\n\n</think>\n\n" in tok.decode(ids.tolist())
    # Without the served argument the template's empty block is trained as if the target wrote it.
    on = samples(tok, record)
    assert supervised_text(tok, *on.samples[-1]) == "<think>\n\n</think>\n\nGoodbye." + CHATML_EOT


def test_weight_zero_turns_are_context(chatml):
    tok = load_tokenizer(str(chatml))
    record = {"messages": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "WRONG.", "weight": 0},
                           {"role": "user", "content": "B?"}, {"role": "assistant", "content": "Right."}]}
    texts = [supervised_text(tok, ids, mask) for ids, mask in samples(tok, record).samples]
    assert "WRONG" not in "".join(texts) and any("Right." in t for t in texts)


# -- mixtures, held-out split, duplicates -------------------------------------------------------------------


def lines_of(prefix: str, n: int) -> list[str]:
    return [json.dumps(openai([("user", f"{prefix} question {i}?"), ("assistant", f"{prefix} answer {i}.")]))
            for i in range(n)]


def test_inputs_mix_with_weights_and_are_counted_per_source(chatml, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", lines_of("alpha", 10))
    b = write_jsonl(tmp_path / "b.jsonl", lines_of("beta", 40))
    meta = prepare(str(chatml), [f"{a}:2", f"{b}:0.5"], str(tmp_path / "ds"), Options())
    sa, sb = meta["sources"]
    assert (sa["lines"], sa["kept_lines"], sa["draws"]) == (10, 10, 20)  # every line twice
    assert sb["lines"] == 40 and sb["draws"] == sb["kept_lines"] == 40 - sb["not_drawn"] and 8 <= sb["draws"] <= 32
    assert meta["num_samples"] == sa["draws"] + sb["draws"]
    assert meta["num_supervised_tokens"] == sa["supervised_tokens"] + sb["supervised_tokens"]
    again = prepare(str(chatml), [f"{a}:2", f"{b}:0.5"], str(tmp_path / "ds2"), Options())
    assert again["sources"] == meta["sources"]  # seeded
    ds, ds2 = open_dataset(tmp_path / "ds"), open_dataset(tmp_path / "ds2")
    assert np.array_equal(ds.tokens, ds2.tokens)
    with pytest.raises(SourceError, match="given twice"):  # never a silent replace
        prepare(str(chatml), [str(a), f"{a}:3"], str(tmp_path / "ds3"), Options())


def test_source_weights_parse():
    assert parse_source("x.jsonl:1.5").weight == 1.5 and parse_source("x.jsonl").weight == 1.0
    with pytest.raises(SourceError, match="weight"):
        parse_source("x.jsonl:-1")


def test_heldout_conversations_are_prompts_and_never_trained_and_duplicates_counted(chatml, tmp_path):
    lines = lines_of("gamma", 12)
    src = write_jsonl(tmp_path / "c.jsonl", lines + lines[:3])  # three exact duplicates
    meta = prepare(str(chatml), str(src), str(tmp_path / "ds"), Options(), selection=Selection(heldout=4, dedup=True))
    assert meta["heldout"]["conversations"] == 4 and meta["duplicates"] == 3
    prompts = read_prompt_file(tmp_path / "ds" / "heldout.jsonl")  # what train.eval_bench / evaluate read
    assert prompts.kind == "turns" and len(prompts.items) == 4
    held = {p[0] for p in prompts.items}
    assert len(held) == 4 and held <= {json.loads(ln)["messages"][0]["content"] for ln in lines}
    tok = load_tokenizer(str(chatml))
    ds = open_dataset(tmp_path / "ds")
    trained = [tok.decode(ds.sample(i)[0].tolist()) for i in range(len(ds))]
    assert not any(q in t for q in held for t in trained)  # not even a duplicate of a held-out line
    assert len(ds) == 15 - 4 - 3 and len(set(trained)) == len(trained)
    again = prepare(str(chatml), str(src), str(tmp_path / "ds2"), Options(), selection=Selection(heldout=4))
    assert (tmp_path / "ds2" / "heldout.jsonl").read_text() == (tmp_path / "ds" / "heldout.jsonl").read_text()
    assert again["duplicates"] == 3 and again["num_samples"] == 15 - 4 - sum(
        1 for ln in lines[:3] if json.loads(ln)["messages"][0]["content"] in held)  # copies of held-out dropped


def test_duplicates_are_counted_and_kept_without_dedup(chatml, tmp_path):
    lines = lines_of("delta", 5)
    src = write_jsonl(tmp_path / "c.jsonl", lines + lines[:2])
    meta = prepare(str(chatml), str(src), str(tmp_path / "ds"), Options())
    assert meta["duplicates"] == 2 and meta["num_samples"] == 7


# -- the target's context, the served template arguments, pre-tokenized rows ----------------------------------


def args_of(*argv: str) -> argparse.Namespace:
    return parser("").parse_args(["--input", "x", "--output", "y", *argv])


def test_max_length_defaults_to_the_targets_context_and_is_bounded_by_it(chatml, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    assert max_length(args_of("--tokenizer", str(chatml), "--target-config", str(target))) == 64
    assert max_length(args_of("--tokenizer", str(chatml), "--target-config", str(target), "--max-length", "32")) == 32
    assert max_length(args_of("--tokenizer", str(chatml))) == 0  # nothing known: no limit
    for n in ("100", "0"):
        with pytest.raises(SourceError, match="max_position_embeddings 64"):
            max_length(args_of("--tokenizer", str(chatml), "--target-config", str(target), "--max-length", n))
    long = json.dumps(openai([("user", "x" * 80), ("assistant", "y.")]))
    src = write_jsonl(tmp_path / "c.jsonl", [long, lines_of("e", 1)[0]])
    code = main(["--tokenizer", str(chatml), "--target-config", str(target), "--input", str(src),
                 "--output", str(tmp_path / "ds")])
    meta = open_dataset(tmp_path / "ds").meta
    assert code == 0 and meta["max_length"] == 64 and meta["skipped"]["over_length"] == 1
    assert int(open_dataset(tmp_path / "ds").offsets[-1]) <= 64


def test_thinking_flags_fold_into_the_template_arguments(chatml):
    opts, _ = options(args_of("--tokenizer", str(chatml), "--no-thinking", "--chat-template-kwargs", '{"x": 1}'))
    assert opts.template_kwargs == {"x": 1, "enable_thinking": False}
    with pytest.raises(SourceError, match="enable_thinking"):
        options(args_of("--tokenizer", str(chatml), "--enable-thinking",
                        "--chat-template-kwargs", '{"enable_thinking": false}'))
    with pytest.raises(SourceError, match="JSON object"):
        options(args_of("--tokenizer", str(chatml), "--chat-template-kwargs", "[1]"))


def test_chat_template_file_replaces_the_tokenizers(chatml, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    src = write_jsonl(tmp_path / "c.jsonl", lines_of("f", 2))
    meta = prepare(str(chatml), str(src), str(tmp_path / "ds"), Options(chat_template=str(template)))
    tok = load_tokenizer(str(chatml))
    ids, mask = open_dataset(tmp_path / "ds").sample(0)
    assert tok.decode(ids.tolist()).startswith("[user]f question 0?")
    assert supervised_text(tok, ids, mask) == "f answer 0.<|im_end|>" and meta["num_samples"] == 2


def test_pretokenized_rows_pass_through_exactly(chatml, tmp_path):
    rows = [{"input_ids": [10, 11, 12, 13, 14], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [20, 21], "loss_mask": [0, 0]},  # nothing supervised: skipped, counted
            {"input_ids": list(range(30, 100)), "loss_mask": [1] * 70}]  # over --max-length 64
    src = write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in rows] + lines_of("g", 1))
    meta = prepare(str(chatml), str(src), str(tmp_path / "ds"), Options(max_length=64))
    ds = open_dataset(tmp_path / "ds")
    ids, mask = ds.sample(0)
    assert ids.tolist() == rows[0]["input_ids"] and mask.tolist() == rows[0]["loss_mask"]
    assert meta["skipped"]["no_supervised"] == 1 and meta["skipped"]["over_length"] == 1
    assert meta["replies"]["pretokenized_rows"] == 1 and len(ds) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"input_ids": [1, 500], "loss_mask": [0, 1]})])
    with pytest.raises(InputError, match=r"bad.jsonl:1: input_ids hold id 500"):
        prepare(str(chatml), str(bad), str(tmp_path / "dsb"), Options())


def test_bad_flags_exit_2(chatml, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", lines_of("h", 1))
    base = ["--tokenizer", str(chatml), "--output", str(tmp_path / "o")]
    assert main([*base, "--input", str(src), "--input", str(src)]) == 2
    assert main([*base, "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert main([*base, "--input", f"{src}:-2"]) == 2
    assert main([*base, "--input", str(src), "--chat-template", str(tmp_path / "none.jinja")]) == 2
    parquet_named_jsonl = tmp_path / "p.jsonl"
    parquet_named_jsonl.write_bytes(b"PAR1\x15\x04\x15\x00" * 8)
    assert main([*base, "--input", str(parquet_named_jsonl)]) == 2  # the reader's refusal, before any line
    assert not (tmp_path / "o").exists()
