"""Conversations in, conversations out: parsing a chat JSONL line, rendering the prompt of assistant turn
k with the target's chat template, and writing the target's reply back into the line's own schema.

The line is kept as parsed (OpenAI `messages` or ShareGPT `conversations`, any extra keys included):
only its assistant turns change, so the output is read by `data.prepare` exactly as the input was.
Each regenerated assistant message gets the target's reply as its text, `token_ids` (the ids the target
generated, its end token left out: prepare trains on them rather than on the re-tokenized text) and
`finish_reason` ("stop", or "length" for a reply cut at its token limit, which prepare supervises
without an end of turn). The old model's reasoning (reasoning_content, reasoning or thinking) is dropped:
the target's reply carries its own reasoning as it wrote it (e.g. a <think> block), and keeping the old one
would pair another model's reasoning with this reply. Its tool calls go the same way: the target writes its
own call in its reply (e.g. Qwen3's <tool_call> block), which the template renders verbatim; a ShareGPT
function_call turn becomes a gpt turn. Tool results, and assistant turns of weight 0 (context: OpenAI's
per-message weight, or a greeting before the first user turn), are kept as recorded. The line's `tools`
go to the chat template with every prompt, as the target is served with them. Messages after the last
assistant turn are left as they are (prepare drops them). A pre-tokenized row has no conversation to
regenerate: skipped as pre_tokenized.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from dflash_dist.data.jsonl import CUT, LINE_SKIPS, Skip, Tokenized, read_record, template_view
from dflash_dist.data.messages import REASONING_KEYS
from dflash_dist.data.prepare import end_of_turn_marker

log = logging.getLogger(__name__)

# Every reason a line yields no output line, the reader's first (data.jsonl: the same as prepare's for
# the same line); the counts go to the log and to the meta file.
SKIP_REASONS = LINE_SKIPS + ("template_error", "over_context", "cut", "pre_tokenized")
_dropped_logged = False


@dataclass
class Conversation:
    """One input line on its way through the turns. `messages` is the normalised view (role, content),
    cut after the last assistant turn; `obj` is the parsed line, whose assistant texts are replaced."""
    line_no: int
    obj: dict
    messages: list[dict[str, Any]]
    turns: list[int] = field(default_factory=list)  # indices of the assistant messages to regenerate, in order
    tools: list[dict] | None = None  # the line's tools, given to the chat template
    cut_turns: int = 0  # replies that reached the token limit (kept under --on-length keep)
    new_tokens: int = 0
    reasoning_dropped: int = 0  # the input's reasoning fields removed from regenerated turns
    tool_calls_replaced: int = 0  # the input's tool calls replaced by the target's reply (its own call, if any)
    tools_not_rendered: bool = False  # the chat template ignores the line's tools

    @property
    def raw_messages(self) -> list[dict]:
        return self.obj["messages"] if "messages" in self.obj else self.obj["conversations"]

    def set_reply(self, k: int, text: str, ids: list[int], stopped: bool) -> None:
        """Assistant message k is now the target's reply (`text`, decoded from `ids`), in the normalised
        view and in the line itself; the old reasoning and tool calls go (module docstring)."""
        finish = "stop" if stopped else CUT
        self.messages[k] = {"role": "assistant", "content": text, "token_ids": list(ids), "finish_reason": finish}
        raw = self.raw_messages[k]
        if any([raw.pop(key, None) is not None for key in REASONING_KEYS]):  # a list: every field goes
            self.reasoning_dropped += 1
            _log_dropped_once()
        calls = [raw.pop(key, None) for key in ("tool_calls", "function_call")]
        sharegpt = "from" in raw
        role_key = "from" if sharegpt else "role"
        if raw.get(role_key) == "function_call":  # the value was the call itself
            raw[role_key] = "gpt" if sharegpt else "assistant"
            calls.append(True)
        self.tool_calls_replaced += any(calls)
        raw.update({"value" if sharegpt else "content": text, "token_ids": list(ids), "finish_reason": finish})

    def to_line(self) -> str:
        return json.dumps(self.obj, ensure_ascii=False)


def _log_dropped_once() -> None:
    global _dropped_logged
    if not _dropped_logged:
        _dropped_logged = True
        log.info("the input's reasoning_content is dropped from every regenerated turn: the target's reply carries "
                 "its own reasoning (counted as reasoning_content_dropped in the meta file)")


def parse_line(line_no: int, raw: bytes | str) -> Conversation:
    """A Conversation, or Skip(reason) naming what is wrong with the line (data.jsonl reads it)."""
    rec = read_record(raw)  # validates every message; index i is the line's message i
    if isinstance(rec, Tokenized):
        raise Skip("pre_tokenized", "a pre-tokenized row (input_ids) has no conversation to regenerate")
    turns = [k for k, m in enumerate(rec.messages) if m["role"] == "assistant" and m.get("weight") != 0]
    return Conversation(line_no=line_no, obj=rec.source, messages=rec.messages, turns=turns, tools=rec.tools)


class ChatRenderer:
    """The target's tokenizer and chat template: prompt token ids of a turn, reply text of token ids."""

    def __init__(self, tokenizer, enable_thinking: bool | None = None):
        self.tok = tokenizer
        # Passed to the template only when asked: templates without the variable ignore it anyway, and
        # leaving it out keeps the template's own default (Qwen3: thinking on).
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt text of `messages` with the generation prompt (and `tools`, when the line has them)."""
        extra = {"tools": tools} if tools else {}
        try:
            return self.tok.apply_chat_template(template_view(messages), tokenize=False, add_generation_prompt=True,
                                                **extra, **self.template_kwargs)
        except Exception as exc:  # jinja raises on templates' own checks (e.g. "roles must alternate")
            raise Skip("template_error", f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def prompt_ids(self, conv: Conversation, k: int) -> list[int]:
        """Token ids of messages[:k] rendered with the generation prompt: what the target sees before
        it writes assistant turn k (the earlier assistant turns are already its own)."""
        text = self.render(conv.messages[:k], conv.tools)
        if conv.tools and k == conv.turns[0] and text == self.render(conv.messages[:k], None):
            conv.tools_not_rendered = True  # the target would be served without them: counted
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def reply_text(self, ids: list[int]) -> str:
        # Special tokens the target wrote inside its reply (e.g. <think>) are part of what it said.
        return self.tok.decode(ids, skip_special_tokens=False)


def stop_token_ids(tokenizer, generation_config: dict[str, Any] | None) -> list[int]:
    """Where a reply ends: the target's generation_config end tokens, the tokenizer's end-of-sequence
    token and the chat template's end-of-turn marker when it is one token (e.g. <|im_end|>)."""
    ids: set[int] = set()
    eos = (generation_config or {}).get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    marker = end_of_turn_marker(tokenizer)
    if marker:
        enc = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(enc) == 1:
            ids.add(int(enc[0]))
    if not ids:
        raise ValueError("the target names no end token (generation_config.json eos_token_id, the tokenizer's "
                         "eos_token, or a one-token end-of-turn marker in its chat template): replies would "
                         "only end at --max-new-tokens")
    return sorted(ids)
