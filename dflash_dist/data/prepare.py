"""Tokenize a chat corpus (JSONL) into the on-disk dataset, supervising only the assistant's tokens.

    python -m dflash_dist.data.prepare --tokenizer DIR --input FILE.jsonl --output DIR \
        [--max-length N] [--last-turn-only] [--no-reasoning-loss] [--workers N] [--overwrite]

Input lines: OpenAI {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]} or ShareGPT
{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}. Messages after the last
assistant turn carry no supervision and are dropped.

How assistant spans are found (character level, then mapped to tokens):
  * The conversation is rendered once with the tokenizer's chat template; that text is what is
    tokenized and trained on.
  * Turn k starts where `render(messages[:k], add_generation_prompt=True)` ends, which must be a
    prefix of the full text (the generation prompt, e.g. "<|im_start|>assistant\\n", is not supervised).
  * It ends where `render(messages[:k+1])` ends when that is also a prefix of the full text. Templates
    that rewrite earlier turns (Qwen3 drops the reasoning of past turns) break this, so the fallback is
    the template's end-of-turn marker (found once by rendering a probe conversation), searched from the
    turn's start. Trailing whitespace after the turn is not supervised.
  * So the supervised text is the assistant content plus the end-of-turn marker (e.g. "<|im_end|>"),
    which a drafter must learn to propose. A token is supervised when its first character is.
  This needs no `{% generation %}` markup in the template (most templates, Qwen3's included, have none)
  and works on the exact text the template produces. A turn it cannot place is a counted skip.
  * --no-reasoning-loss also unmarks every <think>...</think> block (tags and the whitespace after
    them included; a block opened in the generation prompt runs from the turn start to </think>).

Samples longer than --max-length are skipped and counted, never truncated; malformed lines are logged
with their line numbers, skipped and counted. The counts go into meta.json ("skipped").
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_dist.observe.bars import Bar
from dflash_dist.data.disk import DatasetWriter

log = logging.getLogger(__name__)

SKIP_REASONS = ("blank_line", "bad_json", "bad_format", "bad_text", "unknown_role", "empty_conversation",
                "no_assistant", "template_error", "span_not_found", "no_supervised", "over_length", "unexpected_error")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
OPENAI_ROLES = {"system", "user", "assistant"}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "\u2063dflash-probe\u2063"  # text no real reply contains
LOGGED_PER_REASON = 20  # warnings shown per reason; the rest go to DEBUG (the counts stay exact)


class Skip(Exception):
    """This line yields no sample: `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Options:
    max_length: int = 0  # 0 = no limit
    last_turn_only: bool = False
    no_reasoning_loss: bool = False


# ----------------------------------------------------------------------------------- parsing

def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        text = content
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in content):
        text = "".join(p["text"] for p in content)
    else:
        raise Skip("bad_format", f"{where}: content must be a string or a list of text parts")
    try:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer (nor UTF-8) takes
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise Skip("bad_text", f"{where}: not valid Unicode text ({exc.reason} at character {exc.start})") from exc
    return text


def parse_messages(obj: Any) -> list[dict[str, str]]:
    """Normalise one JSON line to [{"role", "content"}], cut after the last assistant turn."""
    if not isinstance(obj, dict):
        raise Skip("bad_format", "expected a JSON object")
    if "messages" in obj:
        raw, role_key, text_key, roles = obj["messages"], "role", "content", {r: r for r in OPENAI_ROLES}
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
        if m[role_key] not in roles:
            raise Skip("unknown_role", f"message {i}: unknown role {m[role_key]!r} (expected one of {sorted(roles)})")
        messages.append({"role": roles[m[role_key]], "content": _text(m[text_key], f"message {i}")})
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 0:
        raise Skip("no_assistant", "no assistant turn")
    return messages[:last + 1]


# ----------------------------------------------------------------------------------- spans

def end_of_turn_marker(tokenizer) -> str:
    """What the template writes after an assistant reply (e.g. "<|im_end|>"), or "" if unknown."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template may reject the probe; then only prefix-stable renders work
        return ""
    i = text.rfind(_PROBE)
    return text[i + len(_PROBE):].strip() if i >= 0 else ""


def assistant_spans(render, messages: list[dict[str, str]], full: str, eot: str,
                    last_turn_only: bool) -> list[tuple[int, int]]:
    """Character spans [start, end) of the supervised assistant turns in `full`."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        turns = turns[-1:]
    spans = []
    for k in turns:
        prompt = render(messages[:k], True)
        if not full.startswith(prompt):
            raise Skip("span_not_found", f"message {k}: the template's generation prompt is not a prefix of "
                                         "the rendered conversation")
        start = len(prompt)
        turn = render(messages[:k + 1], False)
        if full.startswith(turn):
            end = len(turn.rstrip())
        else:  # the template rewrites this turn once later turns follow: end at its end-of-turn marker
            j = full.find(eot, start) if eot else -1
            if j < 0:
                raise Skip("span_not_found", f"message {k}: cannot find the end of this assistant turn")
            end = j + len(eot)
        spans.append((start, max(start, end)))
    return spans


def reasoning_blocks(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """<think>...</think> blocks inside [start, end), with the whitespace that follows each."""
    blocks, pos = [], start
    while pos < end:
        o, c = text.find(THINK_OPEN, pos, end), text.find(THINK_CLOSE, pos, end)
        if o < 0 and c < 0:
            break
        # A close with no open before it: the block was opened in the generation prompt.
        b0 = o if o >= 0 and (c < 0 or o < c) else pos
        c = text.find(THINK_CLOSE, b0, end)
        b1 = end if c < 0 else c + len(THINK_CLOSE)  # an unclosed block runs to the end of the turn
        while b1 < end and text[b1].isspace():
            b1 += 1
        blocks.append((b0, b1))
        pos = b1
    return blocks


# ----------------------------------------------------------------------------------- one sample

def encode(tokenizer, messages: list[dict[str, str]], opts: Options, eot: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32) and loss mask (uint8) of one conversation."""
    def render(msgs, generation_prompt):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        full = render(messages, False)
        spans = assistant_spans(render, messages, full, eot, opts.last_turn_only)
    except Skip:
        raise
    except Exception as exc:  # jinja raises on templates' own checks (e.g. "roles must alternate")
        raise Skip("template_error", f"chat template failed: {type(exc).__name__}: {exc}") from exc
    char_mask = np.zeros(len(full) + 1, dtype=bool)  # +1: zero-width tokens at the very end read False
    for a, b in spans:
        char_mask[a:b] = True
        if opts.no_reasoning_loss:
            for r0, r1 in reasoning_blocks(full, a, b):
                char_mask[r0:r1] = False
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.uint32)
    starts = np.fromiter((s for s, _ in enc["offset_mapping"]), dtype=np.int64, count=len(ids))
    mask = char_mask[starts].astype(np.uint8)
    if opts.max_length and len(ids) > opts.max_length:
        raise Skip("over_length", f"{len(ids)} tokens > --max-length {opts.max_length}")
    if not mask.any():
        raise Skip("no_supervised", "no supervised token")
    return ids, mask


# ----------------------------------------------------------------------------------- workers

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, opts: Options) -> None:
    tok = load_tokenizer(tokenizer_dir)
    _worker.update(tokenizer=tok, opts=opts, eot=end_of_turn_marker(tok))


def _process(item: tuple[int, bytes]) -> tuple[int, str | None, Any]:
    """(line number, None, (ids, mask)) for a sample, (line number, reason, message) for a skip."""
    line_no, raw = item
    try:
        if not raw.strip():
            raise Skip("blank_line", "blank line")
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise Skip("bad_json", f"bad JSON: {type(exc).__name__}: {exc}") from exc
        messages = parse_messages(obj)
        return line_no, None, encode(_worker["tokenizer"], messages, _worker["opts"], _worker["eot"])
    except Skip as skip:
        return line_no, skip.reason, str(skip)
    except Exception as exc:  # whatever else one line makes the tokenizer raise costs that line, not the run
        return line_no, "unexpected_error", f"{type(exc).__name__}: {exc}"


def load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer  # optional extra: only preparing data needs it
    except ImportError as exc:
        raise ImportError("dflash_dist.data.prepare needs transformers: pip install 'dflash_dist[hf]'") from exc
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path}: a fast tokenizer is required (character offsets map spans to tokens)")
    if not tok.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat_template")
    return tok


def _blocks(path: Path, size: int) -> Iterator[list[tuple[int, bytes]]]:
    """Numbered lines, `size` at a time, so memory stays bounded whatever the file size."""
    block: list[tuple[int, bytes]] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            block.append((line_no, raw))
            if len(block) == size:
                yield block
                block = []
    if block:
        yield block


# ----------------------------------------------------------------------------------- driver

def prepare(tokenizer_dir: str, input_path: str, output_dir: str, opts: Options, *, workers: int = 1,
            overwrite: bool = False, progress_s: float = 10.0) -> dict[str, Any]:
    """Tokenize `input_path` into `output_dir` (atomically). Returns the meta written to meta.json."""
    src = Path(input_path)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: input file not found")
    if Path(output_dir).exists() and not overwrite:  # before the slow transformers import
        raise FileExistsError(f"{output_dir} already exists (pass --overwrite to replace it)")
    tok = load_tokenizer(tokenizer_dir)
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    kept = lines = 0
    total_bytes = max(src.stat().st_size, 1)
    t0 = time.monotonic()
    init = (tokenizer_dir, opts)
    # fork: workers inherit the imported modules (importing transformers costs seconds per process)
    # and load their own tokenizer; the parent has not run the tokenizer's thread pool, so fork is safe.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, _init_worker, init) if workers > 1 else None
    if pool is None:
        _init_worker(*init)
    try:
        with DatasetWriter(output_dir, vocab_size=len(tok), overwrite=overwrite) as writer, \
                Bar(total_bytes, f"prepare {src.name}", "B", unit_scale=True, every_s=progress_s, logger=log) as bar:
            for block in _blocks(src, max(1, workers) * 512):
                block_bytes = sum(len(raw) for _, raw in block)
                results = pool.imap(_process, block, chunksize=32) if pool else map(_process, block)
                for line_no, reason, payload in results:
                    lines += 1
                    if reason is None:
                        writer.add(*payload)
                        kept += 1
                        continue
                    skipped[reason] += 1
                    if reason != "blank_line":
                        level = logging.WARNING if skipped[reason] <= LOGGED_PER_REASON else logging.DEBUG
                        log.log(level, "%s:%d: skipped (%s): %s", src, line_no, reason, payload)
                        if skipped[reason] == LOGGED_PER_REASON:
                            log.warning("further '%s' lines are logged at DEBUG level only", reason)
                bar.update(block_bytes, lines=lines, kept=kept, skipped=lines - kept)
            if kept == 0:
                raise ValueError(f"{src}: no usable sample in {lines} lines (skipped: {skipped})")
            meta = {
                "tokenizer": str(Path(tokenizer_dir).absolute()),
                "tokenizer_name": getattr(tok, "name_or_path", ""),
                "max_length": opts.max_length or None,
                "skipped": skipped,
                "made_by": {
                    "tool": "dflash_dist.data.prepare",
                    "input": str(src.absolute()),
                    "input_lines": lines,
                    "options": asdict(opts),
                    "end_of_turn_marker": end_of_turn_marker(tok),
                    "supervision": "assistant content + end-of-turn marker; generation prompt and trailing "
                                   "whitespace excluded" + ("; <think> blocks excluded" if opts.no_reasoning_loss
                                                            else ""),
                    "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                },
            }
            writer.commit(meta)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    meta.update(num_samples=writer.num_samples, num_tokens=writer.num_tokens,
                num_supervised_tokens=writer.num_supervised, vocab_size=writer.vocab_size)
    log.info("prepare: %d lines -> %d samples, %d tokens (%d supervised) in %.1f s; skipped %s", lines, kept,
             writer.num_tokens, writer.num_supervised, time.monotonic() - t0,
             {k: v for k, v in skipped.items() if v})
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.data.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory (with a chat template)")
    ap.add_argument("--input", required=True, help="JSONL file of conversations")
    ap.add_argument("--output", required=True, help="dataset directory to create")
    ap.add_argument("--max-length", type=int, default=0, help="skip (and count) samples with more tokens")
    ap.add_argument("--last-turn-only", action="store_true", help="supervise only the last assistant turn")
    ap.add_argument("--no-reasoning-loss", action="store_true", help="leave <think> blocks out of the loss")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.max_length < 0 or args.workers < 1:
        ap.error("--max-length must be >= 0 and --workers >= 1")
    opts = Options(max_length=args.max_length, last_turn_only=args.last_turn_only,
                   no_reasoning_loss=args.no_reasoning_loss)
    try:
        meta = prepare(args.tokenizer, args.input, args.output, opts, workers=args.workers,
                       overwrite=args.overwrite)
    except (OSError, ValueError, ImportError) as exc:
        log.error("%s", exc)
        return 1
    # The command's result, one JSON line on stdout for scripts; progress and diagnostics go to logging.
    sys.stdout.write(json.dumps({k: meta[k] for k in ("num_samples", "num_tokens", "num_supervised_tokens",
                                                       "skipped")}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
