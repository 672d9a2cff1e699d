"""Conversations in, conversations out: parsing a chat JSONL line, rendering the prompt of assistant turn
k with the target's chat template, and writing the target's reply back into the line's own schema.

The line is kept as parsed (OpenAI `messages` or ShareGPT `conversations`, any extra keys included):
only the text of its assistant turns changes, so the output is read by `data.prepare` exactly as the
input was. Messages after the last assistant turn are left as they are (prepare drops them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflash_dist.data.prepare import Skip, end_of_turn_marker, parse_messages

# Every reason a line yields no output line; the counts go to the log and to the meta file.
SKIP_REASONS = ("blank_line", "bad_json", "bad_format", "unknown_role", "empty_conversation", "no_assistant",
                "template_error", "over_context", "cut")


@dataclass
class Conversation:
    """One input line on its way through the turns. `messages` is the normalised view (role, content),
    cut after the last assistant turn; `obj` is the parsed line, whose assistant texts are replaced."""
    line_no: int
    obj: dict
    messages: list[dict[str, str]]
    turns: list[int] = field(default_factory=list)  # indices of the assistant messages, in order
    cut_turns: int = 0  # replies that reached the token limit (kept under --on-length keep)
    new_tokens: int = 0

    @property
    def raw_messages(self) -> list[dict]:
        return self.obj["messages"] if "messages" in self.obj else self.obj["conversations"]

    def set_reply(self, k: int, text: str) -> None:
        """Assistant message k now says `text`, in the normalised view and in the line itself."""
        self.messages[k] = {"role": "assistant", "content": text}
        self.raw_messages[k]["content" if "messages" in self.obj else "value"] = text

    def to_line(self) -> str:
        return json.dumps(self.obj, ensure_ascii=False)


def parse_line(line_no: int, raw: bytes | str) -> Conversation:
    """A Conversation, or Skip(reason) naming what is wrong with the line."""
    if not raw.strip():
        raise Skip("blank_line", "blank line")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise Skip("bad_json", f"bad JSON: {exc}") from exc
    messages = parse_messages(obj)  # validates every message; index i is the line's message i
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    return Conversation(line_no=line_no, obj=obj, messages=messages, turns=turns)


class ChatRenderer:
    """The target's tokenizer and chat template: prompt token ids of a turn, reply text of token ids."""

    def __init__(self, tokenizer, enable_thinking: bool | None = None):
        self.tok = tokenizer
        # Passed to the template only when asked: templates without the variable ignore it anyway, and
        # leaving it out keeps the template's own default (Qwen3: thinking on).
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def prompt_ids(self, conv: Conversation, k: int) -> list[int]:
        """Token ids of messages[:k] rendered with the generation prompt: what the target sees before
        it writes assistant turn k (the earlier assistant turns are already its own)."""
        try:
            text = self.tok.apply_chat_template(conv.messages[:k], tokenize=False, add_generation_prompt=True,
                                                **self.template_kwargs)
        except Exception as exc:  # jinja raises on templates' own checks (e.g. "roles must alternate")
            raise Skip("template_error", f"chat template failed: {type(exc).__name__}: {exc}") from exc
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
