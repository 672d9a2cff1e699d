"""The one reader of chat and prompt records, shared by `data.prepare`, `data.regenerate` and `evaluate`.

Lines are split on "\\n" alone and numbered from 1: JSON strings may hold U+2028, U+2029 or U+0085 raw
(json.dumps(..., ensure_ascii=False) writes them), which str.splitlines() would take for line ends,
breaking that line and shifting every later line number. A record that yields nothing raises `Skip` with
one of LINE_SKIPS, the same reason for the same line whichever stage reads it. (data.records reads the
files: JSONL, parquet, a `datasets` directory.)

A record (`read_record`) is one of
  * a conversation: OpenAI {"messages": [{"role", "content"}, ...], "tools"?: [...]} or ShareGPT
    {"conversations": [{"from", "value"} or {"role", "content"}, ...], "tools"?: [...] or "[...]"};
    each message normalised by data.messages (roles mapped and counted, reasoning under reasoning_content,
    reasoning or thinking, tool calls and results, per-message weight 0, unknown keys counted);
  * a pre-tokenized row {"input_ids": [...], "loss_mask": [...]} (serving logs), passed through as given.
An assistant message may also carry
  token_ids          the ids the target generated for the content (written by data.regenerate);
  finish_reason      "length" when the reply was cut at its token limit (the target never ended it).
Messages after the last supervised assistant turn are dropped (they carry no supervision). Assistant
turns before the first user turn (a greeting the app wrote) are kept as context: weight 0, counted as
"leading_assistant"; a conversation with no other assistant turn is no_assistant.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dflash_dist.data.messages import decode_tools, normalise
from dflash_dist.data.skip import LINE_SKIPS, Skip, check_text  # noqa: F401  (re-exported: the readers' API)

CUT = "length"  # finish_reason of a reply cut at its token limit (OpenAI's word for it)
# What a chat template is given of a message (token ids, finish reasons and weights are the data's business).
TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


@dataclass
class Conversation:
    """One chat record, normalised (module docstring)."""
    messages: list[dict]  # cut after the last supervised assistant turn; index i is the record's message i
    tools: list[dict] | None = None  # the record's `tools` (a JSON string decoded), for the chat template
    notes: Counter = field(default_factory=Counter)  # what was mapped or left out: "role:developer->system", ...
    source: dict | None = None  # the parsed record (regeneration rewrites it)


@dataclass
class Tokenized:
    """A pre-tokenized row: trained exactly as given."""
    input_ids: list[int]
    loss_mask: list[int]  # 0/1, one per id


def numbered_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw bytes) of every line, split on b"\\n" only (binary files split nowhere
    else); the last line counts without its newline."""
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def decode_line(raw: bytes | str) -> Any:
    """The JSON value of one line, or Skip: blank_line, bad_json (not JSON, not UTF-8, nested too deep)."""
    if not raw.strip():
        raise Skip("blank_line", "blank line")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise Skip("bad_json", f"not valid JSON: {type(exc).__name__}: {exc}") from exc


def _ids(value: Any, key: str, top: int | None = None) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (top is None or t <= top) for t in value):
        what = "0 or 1" if top == 1 else "non-negative integers"
        raise Skip("bad_format", f"{key} must be a non-empty list of {what}")
    return value


def _tokenized(obj: dict) -> Tokenized:
    """A pre-tokenized row, checked (the ids against a vocabulary are the caller's to check)."""
    if "loss_mask" not in obj:
        raise Skip("bad_format", "a pre-tokenized row needs 'loss_mask' beside 'input_ids' (1 = supervised)")
    mask = [int(t) for t in obj["loss_mask"]] if isinstance(obj["loss_mask"], list) and all(
        isinstance(t, bool) for t in obj["loss_mask"]) else obj["loss_mask"]  # JSON true/false taken as 1/0
    ids, mask = _ids(obj["input_ids"], "input_ids"), _ids(mask, "loss_mask", top=1)
    if len(ids) != len(mask):
        raise Skip("bad_format", f"input_ids has {len(ids)} ids but loss_mask {len(mask)} values")
    return Tokenized(list(ids), list(mask))


def _cut(messages: list[dict], notes: Counter) -> list[dict]:
    """Leading assistant turns become context (weight 0); the conversation ends at its last supervised turn."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    for m in messages[:first_user]:
        if m["role"] == "assistant" and m.get("weight") != 0:
            m["weight"] = 0
            notes["leading_assistant"] += 1
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight") != 0), default=-1)
    if last < 0:
        if any(m["role"] == "assistant" for m in messages):
            raise Skip("no_assistant", "no assistant turn to supervise (each opens the conversation or has weight 0)")
        raise Skip("no_assistant", "no assistant turn")
    return messages[:last + 1]


def parse_conversation(obj: Any) -> Conversation:
    """One parsed chat record as a Conversation, or Skip naming what is wrong with it."""
    if not isinstance(obj, dict):
        raise Skip("bad_format", "expected a JSON object")
    key = "messages" if "messages" in obj else "conversations" if "conversations" in obj else None
    if key is None:
        raise Skip("bad_format", "neither 'messages' (OpenAI) nor 'conversations' (ShareGPT) key, nor a "
                                 "pre-tokenized row ('input_ids' and 'loss_mask')")
    raw = obj[key]
    if not isinstance(raw, list):
        raise Skip("bad_format", "the conversation must be a list")
    if not raw:
        raise Skip("empty_conversation", "empty conversation")
    notes: Counter = Counter()
    messages = [normalise(m, i, notes) for i, m in enumerate(raw)]
    tools = decode_tools(obj.get("tools"), notes)
    return Conversation(_cut(messages, notes), tools, notes, obj)


def read_record(record: Any) -> Conversation | Tokenized:
    """A conversation or a pre-tokenized row from one JSONL line (bytes or str) or one parsed row (a dict
    from parquet or `datasets`), or Skip naming the reason. Whatever else a record makes the reader raise
    is that record's `unexpected_error`, never the end of the run."""
    try:
        obj = decode_line(record) if isinstance(record, (bytes, str)) else record
        if isinstance(obj, dict) and "messages" not in obj and "conversations" not in obj and "input_ids" in obj:
            return _tokenized(obj)
        return parse_conversation(obj)
    except Skip:
        raise
    except Exception as exc:
        raise Skip("unexpected_error", f"{type(exc).__name__}: {exc}") from exc


def parse_messages(obj: Any) -> list[dict[str, Any]]:
    """The normalised messages of one parsed chat record (parse_conversation's, without the notes)."""
    return parse_conversation(obj).messages


def read_chat_line(raw: bytes | str) -> tuple[dict, list[dict[str, Any]]]:
    """(the parsed line, its normalised messages), or Skip naming the reason (a pre-tokenized row is
    bad_format here: the caller needs a conversation)."""
    rec = read_record(raw)
    if isinstance(rec, Tokenized):
        raise Skip("bad_format", "a pre-tokenized row (input_ids) where a conversation is needed")
    return rec.source, rec.messages


def template_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: TEMPLATE_KEYS only."""
    return [{k: m[k] for k in TEMPLATE_KEYS if k in m} for m in messages]
