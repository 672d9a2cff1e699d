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


# -- a Qwen3-style ChatML template (issue 44): thinking, tools, past turns rendered without their reasoning ---

CHATML_SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                   "<tool_response>", "</tool_response>"]
CHATML_EOT = "<|im_end|>"
# As Qwen3's: a line's tools listed in the system turn; reasoning (reasoning_content, or an inline <think>
# block split off the content) rendered only for assistant turns after the last user message; each tool call
# as <tool_call>{"name", "arguments"}</tool_call>; tool results as a user turn in <tool_response>; thinking off
# puts an empty <think></think> block in the generation prompt.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{% elif m.role == 'assistant' %}"
    "{% set content = m.content if m.content is string else '' %}{% set reasoning = '' %}"
    "{% if m.reasoning_content is string %}{% set reasoning = m.reasoning_content %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}{% endif %}{{ content.lstrip('\n') }}"
    "{% for c in m.tool_calls or [] %}{% set f = c.function %}"
    "{% if loop.first and content or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")


def make_chatml_tokenizer(path: Path, template: str = CHATML_TEMPLATE) -> Path:
    """A character-level tokenizer over printable ASCII (109 ids, fits the tiny target's 128) with ChatML,
    reasoning and tool specials, and the Qwen3-style template above."""
    vocab = {t: i for i, t in enumerate(CHATML_SPECIALS + list(string.printable))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>",
                                   additional_special_tokens=CHATML_SPECIALS[1:])
    fast.chat_template = template
    fast.save_pretrained(path)
    return path
