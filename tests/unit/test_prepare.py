"""Chat JSONL -> on-disk dataset: exactly the assistant tokens are supervised, skips are counted."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import transformers  # noqa: E402,F401  (the dev extra installs it: a missing package fails, never skips)
from chat_fixtures import (  # noqa: E402,F401
    CONV,
    EOT,
    SPECIALS,
    TEMPLATE,
    corpus_lines,
    make_tokenizer,
    openai,
    sharegpt,
    tok_dir,  # noqa: F401  (fixtures)
    write_jsonl,
)

from dflash_dist.data.disk import open_dataset  # noqa: E402
from dflash_dist.data.prepare import Options, _init_worker, _worker, encode, parse_messages, prepare  # noqa: E402

# Like Qwen3: past assistant turns lose their reasoning once the conversation goes on, so rendering a
# prefix that ends at such a turn is NOT a prefix of the full text.
REWRITING_TEMPLATE = ("{% for m in messages %}"
                      "{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
                      "<|assistant|>\n{{ m.content.split('</think>')[-1].lstrip() }}<|end|>\n"
                      "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def setup_worker(tok_dir: Path, opts: Options = Options()):
    _init_worker(str(tok_dir), opts)
    return _worker["tokenizer"]


def supervised_runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


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


# -- issue 19: one bad line is one counted skip with its line number, never the end of a whole prepare ---------


def test_any_other_error_one_line_raises_is_a_counted_skip_too(tok_dir, tmp_path, caplog, monkeypatch):
    """A tokenizer that fails on one input (as the surrogate did before it was caught as bad_text)."""
    import dflash_dist.data.prepare as prep
    real = prep.encode

    def flaky(tok, messages, opts, eot, notes=None, **kw):  # kw: the line's tools, the sample's turns
        if "poison" in messages[-1]["content"]:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return real(tok, messages, opts, eot, notes, **kw)
    monkeypatch.setattr(prep, "encode", flaky)
    lines, expected = corpus_lines()
    src = write_jsonl(tmp_path / "chat.jsonl", lines + [json.dumps(openai([("user", "q"), ("assistant", "poison")]))])
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.prepare"):
        meta = prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options(max_length=150))
    assert meta["num_samples"] == 3 and meta["skipped"]["unexpected_error"] == 1
    assert f"chat.jsonl:{len(lines) + 1}: skipped (unexpected_error): TypeError: TextEncodeInput" in caplog.text




def test_token_ids_outside_the_vocabulary_stop_the_run_naming_the_file_and_line(tok_dir, tmp_path):
    """Another model's ids: the fast tokenizer's decode drops an unknown id, so without the check the
    other ids matched the reply and the unknown one was trained (a silently wrong sample)."""
    from dflash_dist.data.prepare import InputError
    tok = setup_worker(tok_dir)
    bad = openai(CONV)
    bad["messages"][-1]["token_ids"] = tok("four.", add_special_tokens=False)["input_ids"] + [len(tok)]
    src = write_jsonl(tmp_path / "regen.jsonl", [json.dumps(openai(CONV)), json.dumps(bad)])
    with pytest.raises(InputError, match=rf"regen.jsonl:2: message 4: token_ids hold id {len(tok)}, outside the "
                                         rf"tokenizer's vocabulary of {len(tok)} ids"):
        prepare(str(tok_dir), str(src), str(tmp_path / "ds"), Options())
    assert os.listdir(tmp_path) == ["regen.jsonl"]
