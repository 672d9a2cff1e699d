"""The one reader of chat and prompt JSONL lines, shared by `data.prepare`, `data.regenerate` and `evaluate`.

Lines are split on "\\n" alone and numbered from 1: JSON strings may hold U+2028, U+2029 or U+0085 raw
(json.dumps(..., ensure_ascii=False) writes them), which str.splitlines() would take for line ends,
breaking that line and shifting every later line number. A line that yields nothing raises `Skip` with
one of LINE_SKIPS, the same reason for the same line whichever stage reads it.

A chat line is OpenAI {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]} or ShareGPT
{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}. An assistant message may also carry
  reasoning_content  its reasoning as a string (passed to the chat template, which may render it);
  token_ids          the ids the target generated for the content (written by data.regenerate);
  finish_reason      "length" when the reply was cut at its token limit (the target never ended it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

# Why a line yields no conversation (stages add their own reasons after these).
LINE_SKIPS = ("blank_line", "bad_json", "bad_format", "bad_text", "unknown_role", "empty_conversation",
              "no_assistant", "unexpected_error")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
CUT = "length"  # finish_reason of a reply cut at its token limit (OpenAI's word for it)


class Skip(Exception):
    """This line (or turn) yields no sample: `reason` names why (LINE_SKIPS, or a stage's own)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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


def check_text(text: str, where: str) -> str:
    """`text`, or Skip("bad_text"): JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer
    (nor UTF-8) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Skip("bad_text", f"{where}: not valid Unicode text ({exc.reason} at character {exc.start})") from exc
    return text


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return check_text(content, where)
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return check_text("".join(p["text"] for p in content), where)
    raise Skip("bad_format", f"{where}: content must be a string or a list of text parts")


def _assistant_extras(m: dict, where: str) -> dict[str, Any]:
    """The optional fields of an assistant message (module docstring), checked."""
    out: dict[str, Any] = {}
    if m.get("reasoning_content") is not None:
        if not isinstance(m["reasoning_content"], str):
            raise Skip("bad_format", f"{where}: reasoning_content must be a string")
        out["reasoning_content"] = check_text(m["reasoning_content"], f"{where} reasoning_content")
    if "token_ids" in m:
        ids = m["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise Skip("bad_format", f"{where}: token_ids must be a list of non-negative integers")
        out["token_ids"] = ids
    if "finish_reason" in m:
        if not isinstance(m["finish_reason"], str):
            raise Skip("bad_format", f"{where}: finish_reason must be a string")
        out["finish_reason"] = m["finish_reason"]
    return out


def parse_messages(obj: Any) -> list[dict[str, Any]]:
    """Normalise one parsed line to [{"role", "content"} + an assistant's extras], cut after the last
    assistant turn; index i is the line's message i."""
    if not isinstance(obj, dict):
        raise Skip("bad_format", "expected a JSON object")
    if "messages" in obj:
        raw, role_key, text_key, roles = obj["messages"], "role", "content", OPENAI_ROLES
    elif "conversations" in obj:
        raw, role_key, text_key, roles = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise Skip("bad_format", "neither 'messages' (OpenAI) nor 'conversations' (ShareGPT) key")
    if not isinstance(raw, list):
        raise Skip("bad_format", "the conversation must be a list")
    if not raw:
        raise Skip("empty_conversation", "empty conversation")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or text_key not in m:
            raise Skip("bad_format", f"message {i}: expected an object with '{role_key}' and '{text_key}'")
        role = m[role_key]
        if not isinstance(role, str):  # a list or object would not even hash as a key of `roles`
            raise Skip("bad_format", f"message {i}: '{role_key}' must be a string, not {type(role).__name__}")
        if role not in roles:
            raise Skip("unknown_role", f"message {i}: unknown role {role!r} (expected one of {sorted(roles)})")
        msg = {"role": roles[role], "content": _text(m[text_key], f"message {i}")}
        if msg["role"] == "assistant":
            msg.update(_assistant_extras(m, f"message {i}"))
        messages.append(msg)
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise Skip("no_assistant", "no assistant turn")
    return messages[:last + 1]


def read_chat_line(raw: bytes | str) -> tuple[dict, list[dict[str, Any]]]:
    """(the parsed line, its normalised messages), or Skip naming the reason. Whatever else one line
    makes the parser raise is that line's `unexpected_error`, never the end of the run."""
    try:
        obj = decode_line(raw)
        return obj, parse_messages(obj)
    except Skip:
        raise
    except Exception as exc:
        raise Skip("unexpected_error", f"{type(exc).__name__}: {exc}") from exc


def template_view(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: role, content and reasoning_content (token ids and
    finish reasons are the data's business, not the template's)."""
    keep = ("role", "content", "reasoning_content")
    return [{k: m[k] for k in keep if k in m} for m in messages]
