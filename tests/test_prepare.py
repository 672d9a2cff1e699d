"""Chat JSONL -> on-disk dataset: exactly the assistant tokens are supervised, skips are counted."""
from __future__ import annotations

import json
import logging
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import transformers  # noqa: E402,F401  (the dev extra installs it: a missing package fails, never skips)
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from dflash_dist.data.disk import open_dataset  # noqa: E402
from dflash_dist.data.prepare import (Options, _init_worker, _worker, encode, parse_messages,  # noqa: E402
                                      prepare)

SPECIALS = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
EOT = "<|end|>"
# One block per message; the template itself rejects two messages of the same role in a row.
TEMPLATE = ("{% for m in messages %}"
            "{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
            "{{ raise_exception('roles must alternate') }}{% endif %}"
            "<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Like Qwen3: past assistant turns lose their reasoning once the conversation goes on, so rendering a
# prefix that ends at such a turn is NOT a prefix of the full text.
REWRITING_TEMPLATE = ("{% for m in messages %}"
                      "{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
                      "<|assistant|>\n{{ m.content.split('</think>')[-1].lstrip() }}<|end|>\n"
                      "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_tokenizer(path: Path, template: str = TEMPLATE) -> Path:
    """A character-level tokenizer (50 ids, fits the tiny target's 128) with role-marker specials."""
    chars = list(string.ascii_lowercase + string.digits + " \n.,?!'")
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()  # decode concatenates: decoded text equals the source text exactly
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def setup_worker(tok_dir: Path, opts: Options = Options()):
    _init_worker(str(tok_dir), opts)
    return _worker["tokenizer"]


def supervised_runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


CONV = [("system", "be brief."), ("user", "hi there"), ("assistant", "hello, how can i help?"),
        ("user", "what is two plus two"), ("assistant", "four.")]


def openai(conv):
    return {"messages": [{"role": r, "content": c} for r, c in conv]}


def sharegpt(conv):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in conv]}


@pytest.mark.parametrize("fmt", [openai, sharegpt])
def test_supervised_tokens_are_exactly_the_assistant_turns(tok_dir, fmt):
    tok = setup_worker(tok_dir)
    ids, mask = encode(tok, parse_messages(fmt(CONV)), Options(), EOT)
    assert supervised_runs(tok, ids, mask) == ["hello, how can i help?" + EOT, "four." + EOT]
    # Everything else (system, user turns, generation prompts, trailing newlines) is unsupervised.
    assert tok.decode(ids[mask == 0].tolist()).count("hi there") == 1
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(parse_messages(fmt(CONV)), tokenize=False)


def test_both_formats_give_the_same_sample(tok_dir):
    tok = setup_worker(tok_dir)
    a = encode(tok, parse_messages(openai(CONV)), Options(), EOT)
    b = encode(tok, parse_messages(sharegpt(CONV)), Options(), EOT)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_trailing_user_turn_is_dropped_and_content_parts_are_joined(tok_dir):
    tok = setup_worker(tok_dir)
    obj = openai(CONV[1:3] + [("user", "bye")])
    obj["messages"][1]["content"] = [{"type": "text", "text": "hello, "}, {"type": "text", "text": "friend."}]
    ids, mask = encode(tok, parse_messages(obj), Options(), EOT)
    assert supervised_runs(tok, ids, mask) == ["hello, friend." + EOT]
    assert "bye" not in tok.decode(ids.tolist())


def test_last_turn_only(tok_dir):
    tok = setup_worker(tok_dir)
    ids, mask = encode(tok, parse_messages(openai(CONV)), Options(last_turn_only=True), EOT)
    assert supervised_runs(tok, ids, mask) == ["four." + EOT]


def test_no_reasoning_loss(tok_dir):
    tok = setup_worker(tok_dir)
    conv = [("user", "two plus two?"), ("assistant", "<think>two and two, four</think>\n\nit is four.")]
    ids, mask = encode(tok, parse_messages(openai(conv)), Options(), EOT)
    assert supervised_runs(tok, ids, mask) == ["<think>two and two, four</think>\n\nit is four." + EOT]
    ids, mask = encode(tok, parse_messages(openai(conv)), Options(no_reasoning_loss=True), EOT)
    assert supervised_runs(tok, ids, mask) == ["it is four." + EOT]


def test_template_that_rewrites_past_turns(tmp_path):
    """Spans still land exactly on what the full render contains for each turn."""
    tok = setup_worker(make_tokenizer(tmp_path / "rw", REWRITING_TEMPLATE))
    assert _worker["eot"] == EOT  # found by the probe render
    conv = [("user", "hi"), ("assistant", "<think>greet back</think>\nhello."), ("user", "and?"),
            ("assistant", "<think>add more</think>\nthat is all.")]
    ids, mask = encode(tok, parse_messages(openai(conv)), Options(), _worker["eot"])
    assert supervised_runs(tok, ids, mask) == ["hello." + EOT, "<think>add more</think>\nthat is all." + EOT]
    ids, mask = encode(tok, parse_messages(openai(conv)), Options(no_reasoning_loss=True), _worker["eot"])
    assert supervised_runs(tok, ids, mask) == ["hello." + EOT, "that is all." + EOT]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def corpus_lines() -> tuple[list[str], dict[str, int]]:
    good = [json.dumps(openai(CONV)), json.dumps(sharegpt(CONV[1:3])),
            json.dumps(openai([("user", "q"), ("assistant", "<think>x</think>a.")]))]
    lines = [
        good[0],
        "{not json",  # line 2
        json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),  # 3
        json.dumps({"messages": []}),  # 4
        json.dumps(openai([("system", "s"), ("user", "only a question")])),  # 5
        good[1],
        "",  # 7
        json.dumps(openai([("user", "long " * 40), ("assistant", "ok.")])),  # 8: over --max-length
        json.dumps({"text": "no conversation"}),  # 9
        json.dumps(openai([("user", "a"), ("user", "b"), ("assistant", "c")])),  # 10: template refuses
        good[2],
    ]
    expected = {"bad_json": 1, "unknown_role": 1, "empty_conversation": 1, "no_assistant": 1, "blank_line": 1,
                "over_length": 1, "bad_format": 1, "template_error": 1}
    return lines, expected


def test_skips_are_counted_logged_with_line_numbers_and_stored(tok_dir, tmp_path, caplog):
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=150))
    assert {k: v for k, v in meta["skipped"].items() if v} == expected
    assert meta["num_samples"] == 3 and meta["made_by"]["input_lines"] == len(lines)
    for n in (2, 3, 4, 5, 8, 9, 10):
        assert f"chat.jsonl:{n}: skipped" in caplog.text
    ds = open_dataset(tmp_path / "ds")
    assert ds.meta["skipped"] == meta["skipped"] and ds.meta["max_length"] == 150
    assert ds.vocab_size == len(setup_worker(tok_dir)) == 50
    # The stored samples are the kept lines, in input order, exactly as encode() makes them.
    tok = setup_worker(tok_dir)
    for i, line in enumerate([lines[0], lines[5], lines[10]]):
        ids, mask = encode(tok, parse_messages(json.loads(line)), Options(max_length=150), EOT)
        got_ids, got_mask = ds.sample(i)
        assert np.array_equal(got_ids, ids) and np.array_equal(got_mask, mask)
    assert int(ds.num_supervised.sum()) == meta["num_supervised_tokens"]


def test_no_kept_sample_writes_nothing(tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", ["{", json.dumps({"messages": []})])
    with pytest.raises(ValueError, match="no usable sample"):
        prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options())
    assert not (tmp_path / "ds").exists() and os.listdir(tmp_path) == ["bad.jsonl"]


def test_cli_with_workers_matches_in_process(tok_dir, tmp_path):
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines * 3)
    prepare(str(tok_dir), str(src), str(tmp_path / "ref"), Options(max_length=150, no_reasoning_loss=True))
    cmd = [sys.executable, "-m", "dflash_dist.data.prepare", "--tokenizer", str(tok_dir), "--input", str(src),
           "--output", str(tmp_path / "cli"), "--max-length", "150", "--no-reasoning-loss", "--workers", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["num_samples"] == 9 and summary["skipped"]["over_length"] == 3
    ref, cli = open_dataset(tmp_path / "ref"), open_dataset(tmp_path / "cli")
    for name in ("tokens", "offsets", "loss_mask"):
        assert np.array_equal(getattr(ref, name), getattr(cli, name)), name
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # output exists, no --overwrite
    assert again.returncode == 1 and "already exists" in again.stderr


# -- issue 19: one bad line is one counted skip with its line number, never the end of a whole prepare ---------

HOSTILE = [
    "[" * 100_000 + "]" * 100_000,  # nested past Python's recursion limit: json.loads raises RecursionError
    '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok."}]}',
    '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", '
    '"text": "\\udfff"}]}]}',  # a lone low surrogate in a content part
]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_deeply_nested_or_surrogate_line_is_a_counted_skip_with_its_line_number(tok_dir, tmp_path, caplog, workers):
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines + HOSTILE)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=150), workers=workers)
    n = len(lines)
    assert meta["num_samples"] == 3 and meta["made_by"]["input_lines"] == n + 3
    assert {k: v for k, v in meta["skipped"].items() if v} == dict(expected, bad_json=2, bad_text=2)
    assert re.search(rf"chat\.jsonl:{n + 1}: skipped \(bad_json\): not valid JSON: RecursionError", caplog.text)
    assert f"chat.jsonl:{n + 2}: skipped (bad_text): message 0: not valid Unicode text (surrogates not allowed" \
        in caplog.text
    assert f"chat.jsonl:{n + 3}: skipped (bad_text): message 1:" in caplog.text
    assert open_dataset(tmp_path / "ds").meta["skipped"] == meta["skipped"]


def test_any_other_error_one_line_raises_is_a_counted_skip_too(tok_dir, tmp_path, caplog, monkeypatch):
    """A tokenizer that fails on one input (as the surrogate did before it was caught as bad_text)."""
    import dflash_dist.data.prepare as prep
    real = prep.encode

    def flaky(tok, messages, opts, eot, notes=None):
        if "poison" in messages[-1]["content"]:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return real(tok, messages, opts, eot, notes)
    monkeypatch.setattr(prep, "encode", flaky)
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines + [json.dumps(openai([("user", "q"), ("assistant", "poison")]))])
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=150))
    assert meta["num_samples"] == 3 and meta["skipped"]["unexpected_error"] == 1
    assert f"chat.jsonl:{len(lines) + 1}: skipped (unexpected_error): TypeError: TextEncodeInput" in caplog.text


@pytest.mark.slow
def test_prepared_dataset_trains_under_torchrun(tok_dir, tmp_path):
    """Issue 4's end: chat JSONL -> prepare -> `data.path=DIR` under torchrun with 3 ranks (2 targets, 1 drafter)."""
    from helpers import torchrun

    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "why", "is", "sky", "blue", "light", "scatters", "4", "ok."]
    say = lambda k: " ".join(rng.choice(words, size=k))  # noqa: E731
    convs = [openai([("user", say(rng.integers(2, 8))), ("assistant", say(rng.integers(3, 25)))]) for _ in range(90)]
    lines = [json.dumps(c) for c in convs] + ["{broken", json.dumps(openai([("user", "long " * 60), ("assistant", "x")]))]
    src = write_jsonl(tmp_path / "chat.jsonl", lines)
    meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=200))
    assert meta["num_samples"] == 90 and meta["skipped"]["bad_json"] == 1 and meta["skipped"]["over_length"] == 1

    run = tmp_path / "run"
    res = torchrun(3, [f"data.path={tmp_path / 'ds'}", "plan.token_budget=512"], run)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"] == 3 * 90  # every prepared sample once per epoch
    assert summary["skipped_in_preparation"]["bad_json"] == 1 and summary["skipped_in_preparation"]["over_length"] == 1
    assert all(np.isfinite(e["loss"]) for e in summary["epochs"])
    assert (run / "export" / "model.safetensors").is_file()
