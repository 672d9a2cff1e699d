"""The contract between regeneration's output and preparation's input (issue 29 items 3, 6, 10; issue 27
item 8): one reader of chat/prompt JSONL lines for prepare, regenerate and evaluate; reasoning_content
passed to the template and dropped by regeneration; sampled replies independent of chunking and batching
(hf engine); a cut reply trained without an end of turn; the target's own token ids trained.
Regeneration runs the transformers engine on the tiny float32 target (no vLLM: seconds per job)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from test_prepare import EOT, make_tokenizer, openai, supervised_runs
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_dist.bench.regenerate import conversations, make_target, write_jsonl
from dflash_dist.data.disk import open_dataset
from dflash_dist.data.jsonl import Skip, numbered_lines, read_chat_line
from dflash_dist.data.prepare import Options, encode, prepare
from dflash_dist.data.regen import chunks
from dflash_dist.data.regen.chat import stop_token_ids
from dflash_dist.data.regen.engine import EngineSpec, Sampling
from dflash_dist.data.regen.engines import build_engine
from dflash_dist.data.regen.run import Job, Shard, generation_config, load_tokenizer, run
from dflash_dist.evaluation.prompts import EvalInputError, read_prompt_file

MAX_NEW = 16
LS = "\u2028"  # LINE SEPARATOR: str.splitlines() splits on it (and on U+2029, U+0085); JSON strings may hold it raw


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("contract") / "target")


@pytest.fixture(scope="module")
def hf(target):
    """spec -> engine: one engine per batch size, built once."""
    stops = stop_token_ids(load_tokenizer(str(target)), generation_config(str(target)))
    built = {}

    def get(batch_size: int = 64):
        if batch_size not in built:
            spec = EngineSpec(name="hf", target=str(target), tokenizer=str(target), batch_size=batch_size)
            built[batch_size] = (spec, build_engine(spec, stops))
        return built[batch_size]
    return get


def regen(hf, src: Path, out: Path, *, batch_size=64, chunk_size=8, sampling=Sampling(MAX_NEW), on_length="keep"):
    spec, engine = hf(batch_size)
    job = Job(input=src, output=out, engine=spec, sampling=sampling, on_length=on_length, chunk_size=chunk_size,
              progress_s=1e9)
    assert run(job, Shard(), engine) == 0
    return [json.loads(line) for line in numbered_lines_text(out)], json.loads(chunks.meta_path(out).read_text())


def numbered_lines_text(path: Path) -> list[str]:
    return [raw.decode() for _, raw in numbered_lines(path)]


# -- item 3: one reader, the same reasons, exact line numbers ------------------------------------------------

HOSTILE = {  # line -> the reason every stage gives it
    json.dumps({"messages": [{"role": ["user"], "content": "q"}, {"role": "assistant", "content": "a"}]}): "bad_format",
    json.dumps({"conversations": [{"from": {"x": 1}, "value": "q"}, {"from": "gpt", "value": "a"}]}): "bad_format",
    '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok."}]}': "bad_text",
    json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                  "token_ids": [1, -2]}]}): "bad_format",
}


def test_the_reader_gives_each_hostile_line_its_reason():
    for line, reason in HOSTILE.items():
        with pytest.raises(Skip) as info:
            read_chat_line(line.encode())
        assert info.value.reason == reason, line


def test_regeneration_counts_a_list_role_and_a_surrogate_as_skips_like_prepare(hf, target, tmp_path, caplog):
    good = conversations(4, seed=7)
    lines = [good[0], *HOSTILE, good[1], good[2], good[3]]
    src = write_jsonl(tmp_path / "chats.jsonl", lines)
    with caplog.at_level(logging.INFO):
        got, meta = regen(hf, src, tmp_path / "out.jsonl", chunk_size=3)
    assert [c["id"] for c in got] == [0, 1, 2, 3]
    want = {"bad_format": 3, "bad_text": 1}
    assert {k: v for k, v in meta["skipped"].items() if v} == want  # bad_text inside "skipped", nothing outside
    assert not [k for k in meta if k.startswith("skipped.")]
    for n, reason in enumerate(HOSTILE.values(), start=2):
        assert f"chats.jsonl:{n}: skipped ({reason})" in caplog.text
    assert "'bad_text': 1" in [r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote")][0]
    # prepare counts the same lines under the same reasons (its input here: the very same file).
    tok_dir = make_tokenizer(tmp_path / "tok")
    pmeta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options())
    assert {k: v for k, v in pmeta["skipped"].items() if v} == want


def test_evaluate_reads_a_raw_line_separator_as_text_and_keeps_line_numbers(tmp_path):
    path = tmp_path / "p.jsonl"
    turns = [f"first{LS}half", "second\u2029x\u0085y"]
    path.write_text("".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for t in turns) + "\n[1, 2]\n",
                    encoding="utf-8")
    assert LS in path.read_text(encoding="utf-8")  # raw, as ensure_ascii=False writes it
    with pytest.raises(EvalInputError, match=r"p\.jsonl:4: a ids line in a file of turns prompts"):
        read_prompt_file(path)  # line 4 is the fourth line of the file, whatever the strings hold
    path.write_text(path.read_text(encoding="utf-8").replace("[1, 2]", "{bad"), encoding="utf-8")
    with pytest.raises(EvalInputError, match=r"p\.jsonl:4: bad_json: not valid JSON"):
        read_prompt_file(path)
    path.write_text(path.read_text(encoding="utf-8").replace("{bad", ""), encoding="utf-8")
    pset = read_prompt_file(path)
    assert pset.items == [[t] for t in turns] and pset.lines == [1, 2]


def test_evaluate_names_a_surrogate_turn_and_a_bad_utf8_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["bad \\udc00"]}\n')
    with pytest.raises(EvalInputError, match=r"p\.jsonl:2: bad_text: turn 1: not valid Unicode"):
        read_prompt_file(path)
    path.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["\xff"]}\n')
    with pytest.raises(EvalInputError, match=r"p\.jsonl:2: bad_json"):
        read_prompt_file(path)


# -- item 6: reasoning_content ------------------------------------------------------------------------------

# Like Qwen3's: an assistant turn's reasoning_content is rendered in a think block before its content.
REASONING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n"
                      "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
                      "{{ m.content }}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# A template that writes the reasoning without think tags: --no-reasoning-loss must find it by its text.
BARE_TEMPLATE = REASONING_TEMPLATE.replace("<think>{{ m.reasoning_content }}</think>", "{{ m.reasoning_content }}")

REASONED = [{"role": "user", "content": "what is two plus two?"},
            {"role": "assistant", "content": "four.", "reasoning_content": "two and two make four."}]


@pytest.mark.parametrize("template, shown", [(REASONING_TEMPLATE, "<think>two and two make four.</think>\n"),
                                             (BARE_TEMPLATE, "two and two make four.\n")])
def test_prepare_passes_reasoning_content_to_the_template(tmp_path, template, shown):
    tok = PreTrainedTokenizerFast.from_pretrained(make_tokenizer(tmp_path / "tok", template))
    _, messages = read_chat_line(json.dumps({"messages": REASONED}))
    ids, mask = encode(tok, messages, Options(), EOT)
    assert supervised_runs(tok, ids, mask) == [shown + "four." + EOT]
    ids, mask = encode(tok, messages, Options(no_reasoning_loss=True), EOT)
    assert "two and two" in tok.decode(ids.tolist()) and "two and two" not in "".join(supervised_runs(tok, ids, mask))
    assert supervised_runs(tok, ids, mask)[-1].endswith("four." + EOT)


def test_prepare_counts_reasoning_the_template_does_not_render(tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok")  # its template has no reasoning_content
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": REASONED}])
    meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options())
    assert meta["replies"]["reasoning_content_not_rendered"] == 1


def test_regeneration_drops_the_old_reasoning_content_and_says_so(hf, tmp_path, caplog, monkeypatch):
    from dflash_dist.data.regen import chat
    monkeypatch.setattr(chat, "_dropped_logged", False)  # said once per process: this test's run is one
    lines = [{"id": 0, "messages": REASONED}, {"id": 1, "messages": REASONED[:1] + [{"role": "assistant",
                                                                                        "content": "x"}]}]
    src = write_jsonl(tmp_path / "c.jsonl", lines)
    with caplog.at_level(logging.INFO):
        got, meta = regen(hf, src, tmp_path / "out.jsonl")
    assert all("reasoning_content" not in m for c in got for m in c["messages"])
    assert meta["reasoning_content_dropped"] == 1
    assert "reasoning_content is dropped" in caplog.text


# -- item 10: a sampled reply depends on --seed, its line and its turn only ------------------------------------

def test_hf_sampled_replies_do_not_depend_on_chunking_or_batch_size(hf, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(16, seed=8))
    sampled = Sampling(MAX_NEW, temperature=1.0, top_p=0.9, seed=3)
    ref, _ = regen(hf, src, tmp_path / "a.jsonl", chunk_size=10, sampling=sampled)
    for name, kw in [("chunk20", dict(chunk_size=20)), ("batch4", dict(batch_size=4, chunk_size=10))]:
        regen(hf, src, tmp_path / f"{name}.jsonl", sampling=sampled, **kw)
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes(), name
    greedy, _ = regen(hf, src, tmp_path / "greedy.jsonl", chunk_size=10)
    assert greedy != ref  # it did sample
    other, _ = regen(hf, src, tmp_path / "seed4.jsonl", chunk_size=10,
                     sampling=Sampling(MAX_NEW, temperature=1.0, top_p=0.9, seed=4))
    assert other != ref  # and the seed matters


# -- issue 27 item 8: a cut reply is trained as cut; the target's own tokens are trained -----------------------

def test_regenerated_replies_carry_ids_and_finish_reason_and_prepare_trains_exactly_them(hf, target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(24, seed=9))
    got, meta = regen(hf, src, tmp_path / "out.jsonl", on_length="keep")
    tok = load_tokenizer(str(target))
    replies = [m for c in got for m in c.get("messages", c.get("conversations")) if "token_ids" in m]
    assert len(replies) == meta["replies"]
    cut = [m for m in replies if m["finish_reason"] == "length"]
    assert 0 < len(cut) < len(replies) and all(len(m["token_ids"]) == MAX_NEW for m in cut)
    for m in replies:
        assert tok.decode(m["token_ids"]) == m.get("content", m.get("value"))
    pmeta = prepare(str(target), str(tmp_path / "out.jsonl"), str(tmp_path / "ds"), Options())
    # Every token the target generated is supervised, its end token included, and nothing else: a cut
    # reply gets no end of turn the target never wrote.
    assert pmeta["num_supervised_tokens"] == meta["new_tokens"]
    assert pmeta["replies"]["cut_replies"] == len(cut)
    ds = open_dataset(tmp_path / "ds")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    supervised_eots = sum(int(((ids == eot) & (mask == 1)).sum()) for ids, mask in map(ds.sample, range(len(ds))))
    assert supervised_eots == len(replies) - len(cut)


def test_a_cut_reply_has_no_end_of_turn_label(tmp_path):
    tok = PreTrainedTokenizerFast.from_pretrained(make_tokenizer(tmp_path / "tok"))
    conv = openai([("user", "hi"), ("assistant", "hello th"), ("user", "go on"), ("assistant", "ok.")])
    conv["messages"][1]["finish_reason"] = "length"
    _, messages = read_chat_line(json.dumps(conv))
    ids, mask = encode(tok, messages, Options(), EOT)
    assert supervised_runs(tok, ids, mask) == ["hello th", "ok." + EOT]


def bpe_tokenizer(path: Path) -> Path:
    """Characters plus one merge ("fo" + "o" -> "foo"): "foo" has a canonical id and a non-canonical spelling."""
    chars = list("abcdefghijklmnopqrstuvwxyz .?\n")
    specials = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
    vocab = {t: i for i, t in enumerate(specials + chars + ["fo", "foo"])}
    tk = Tokenizer(models.BPE(vocab, [("f", "o"), ("fo", "o")], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[a-z]+|[^a-z]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", additional_special_tokens=specials[1:])
    fast.chat_template = REASONING_TEMPLATE
    fast.save_pretrained(path)
    return path


def test_prepare_trains_the_targets_ids_where_re_tokenizing_would_differ(tmp_path):
    tok_dir = bpe_tokenizer(tmp_path / "tok")
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    f, o, foo = (tok.convert_tokens_to_ids(t) for t in ("f", "o", "foo"))
    assert tok("foo", add_special_tokens=False)["input_ids"] == [foo]
    spelled = [f, o, o, tok.convert_tokens_to_ids("."), f, o, o]  # what a target may emit: decodes to "foo.foo"
    line = lambda ids, text="foo.foo": {"messages": [  # noqa: E731
        {"role": "user", "content": "say foo"}, {"role": "assistant", "content": text, "token_ids": ids}]}
    dot = tok.convert_tokens_to_ids(".")
    src = write_jsonl(tmp_path / "c.jsonl", [line(spelled), line([foo]), line([foo, dot, foo]), line([], text="")])
    meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options())
    expected = {"cut_replies": 0, "token_ids_replies": 3, "token_ids_same": 1, "token_ids_spliced": 1,
                "token_ids_retokenized": 1, "reasoning_content_not_rendered": 0}
    assert {k: meta["replies"][k] for k in expected} == expected
    ds = open_dataset(tmp_path / "ds")
    ids, mask = ds.sample(0)
    end = tok.convert_tokens_to_ids("<|end|>")
    assert ids[mask == 1].tolist() == spelled + [end]  # the target's seven ids, then the end of turn
    prompt = tok.apply_chat_template(line(spelled)["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert ids[:int(np.argmax(mask))].tolist() == tok(prompt, add_special_tokens=False)["input_ids"]
    re_ids, re_mask = ds.sample(1)  # "foo.foo" carrying ids that decode to "foo": re-tokenized, counted
    assert re_ids[re_mask == 1].tolist() == [foo, dot, foo, end]
    # Spliced ids keep --no-reasoning-loss: the think block among them is unmarked, the answer trained.
    think, unthink, nl = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "\n"))
    reasoned = [think, f, o, o, unthink, nl, f, o, o, dot]
    src = write_jsonl(tmp_path / "r.jsonl", [line(reasoned, text="<think>foo</think>\nfoo.")])
    meta = prepare(str(tok_dir), str(src), str(tmp_path / "dr"), Options(no_reasoning_loss=True))
    ids, mask = open_dataset(tmp_path / "dr").sample(0)
    assert meta["replies"]["token_ids_spliced"] == 1 and ids[mask == 1].tolist() == [f, o, o, dot, end]
    assert reasoned == ids[int(np.flatnonzero(ids == think)[0]):][:len(reasoned)].tolist()



def test_per_reply_sampler_keeps_the_tokens_transformers_top_p_keeps():
    """The hf engine's own drawing applies temperature and top-p as transformers' warpers do."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    from dflash_dist.data.regen.hf import PerReplySampler
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.3, 0.9, 1.0):
        ref = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(0.7)(None, scores.clone()))
        sampler = PerReplySampler(Sampling(8, temperature=0.7, top_p=top_p), list(range(6)), torch.device("cpu"))
        for _ in range(200):  # every draw is one of the tokens transformers keeps, and the argmax is the draw
            out = sampler(None, scores)
            assert torch.isfinite(out).sum(-1).eq(1).all()
            assert torch.isfinite(ref.gather(-1, out.argmax(-1, keepdim=True))).all(), top_p
