"""A chat-template tokenizer made in a directory: what the data-preparation, chat-input and evaluation
tests share (character-level, role-marker specials, the tiny target's vocabulary)."""
from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


SPECIALS = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<think>", "</think>"]
EOT = "<|end|>"
# One block per message; the template itself rejects two messages of the same role in a row.
TEMPLATE = ("{% for m in messages %}"
            "{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
            "{{ raise_exception('roles must alternate') }}{% endif %}"
            "<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
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


CONV = [("system", "be brief."), ("user", "hi there"), ("assistant", "hello, how can i help?"),
        ("user", "what is two plus two"), ("assistant", "four.")]


def openai(conv):
    return {"messages": [{"role": r, "content": c} for r, c in conv]}


def sharegpt(conv):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in conv]}


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
