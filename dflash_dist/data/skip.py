"""Why a record yields no sample: `Skip` and the reader's own reasons, shared by every stage that reads
chat data (data.jsonl re-exports them; kept apart so the message normaliser can raise them too)."""
from __future__ import annotations

# Why a line yields no conversation (stages add their own reasons after these).
LINE_SKIPS = ("blank_line", "bad_json", "bad_format", "bad_text", "unknown_role", "empty_conversation",
              "no_assistant", "unexpected_error")


class Skip(Exception):
    """This line (or turn) yields no sample: `reason` names why (LINE_SKIPS, or a stage's own)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_text(text: str, where: str) -> str:
    """`text`, or Skip("bad_text"): JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer
    (nor UTF-8) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Skip("bad_text", f"{where}: not valid Unicode text ({exc.reason} at character {exc.start})") from exc
    return text
