"""Tokenize a chat corpus (JSONL) into the on-disk dataset, supervising only the assistant's tokens.

    python -m dflash_dist.data.prepare --tokenizer DIR --input FILE.jsonl --output DIR \
        [--max-length N] [--last-turn-only] [--no-reasoning-loss] [--workers N] [--overwrite]

Input lines: OpenAI {"messages": [{"role": "system"|"user"|"assistant", "content": ...}]} or ShareGPT
{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}, read by data.jsonl (the reader
regeneration and evaluation use: the same skip reasons for the same line). Messages after the last
assistant turn carry no supervision and are dropped. An assistant message may carry
  * reasoning_content: passed to the chat template (Qwen3's renders it in a <think> block); a turn whose
    reasoning the template leaves out is counted in meta.json ("replies");
  * token_ids (data.regenerate writes them): the ids the target generated. Re-tokenizing the decoded text
    need not give them back (a model may emit a non-canonical tokenization), so where the template writes
    the reply verbatim and the ids decode to it, they replace the re-tokenized reply; elsewhere (a template
    that rewrites the reply) the re-tokenized text is trained and the reply counted as retokenized. An id
    outside the tokenizer's vocabulary is exit 2 naming the file and line: the replies are another model's;
  * finish_reason "length" (a reply cut at its token limit): supervised without the end-of-turn marker
    the template writes after it, since the target never ended that turn.

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
    them included; a block opened in the generation prompt runs from the turn start to </think>) and
    the rendered text of a reasoning_content (found by its text, so templates without tags work too).

Samples longer than --max-length are skipped and counted, never truncated; malformed lines are logged
with their line numbers, skipped and counted. The counts go into meta.json ("skipped"). The output appears
whole or not at all (data.disk's DatasetWriter); SIGTERM removes the half-written one (exit 143), and a
rerun removes what a killed run left.
"""
from __future__ import annotations

import argparse
import bisect
import json
import logging
import multiprocessing as mp
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_dist.checkpoints.files import terminate_cleanly
from dflash_dist.observe.bars import Bar
from dflash_dist.data.disk import DatasetWriter
from dflash_dist.exits import EXIT_BAD_INPUT
from dflash_dist.data.jsonl import (CUT, LINE_SKIPS, Skip, numbered_lines, parse_messages,  # noqa: F401
                                    read_chat_line, template_view)

log = logging.getLogger(__name__)

SKIP_REASONS = LINE_SKIPS + ("template_error", "span_not_found", "no_supervised", "over_length")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "\u2063dflash-probe\u2063"  # text no real reply contains
LOGGED_PER_REASON = 20  # warnings shown per reason; the rest go to DEBUG (the counts stay exact)
FATAL = "fatal"  # a line that makes the whole input wrong (not one of SKIP_REASONS): the run stops


class InputError(ValueError):
    """Input the whole run cannot use, named by file and line (exit 2)."""


class ForeignIds(ValueError):
    """A reply's token_ids hold an id the tokenizer does not have: they are another model's."""


@dataclass(frozen=True)
class Options:
    max_length: int = 0  # 0 = no limit
    last_turn_only: bool = False
    no_reasoning_loss: bool = False


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
                    last_turn_only: bool) -> list[tuple[int, int, int]]:
    """(message index, start, end): character spans [start, end) of the supervised assistant turns in `full`."""
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
        spans.append((k, start, max(start, end)))
    return spans


def cut_span_end(full: str, start: int, end: int, content: str, eot: str) -> int:
    """Where the supervision of a reply cut at its token limit ends: after its content, before the
    end-of-turn marker the template writes (the target never ended that turn, so no label may say it did)."""
    p = full.find(content, start, end) if content else -1
    if p >= 0:
        return p + len(content)
    if eot and full.endswith(eot, start, end):  # the template rewrote the reply: cut the marker alone
        return end - len(eot)
    return end


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


def reasoning_field(text: str, start: int, end: int, message: dict) -> tuple[int, int] | None:
    """Where the template rendered the message's reasoning_content inside [start, end), or None (the
    template left it out, e.g. Qwen3 for turns before the last user message). Templates strip its
    surrounding newlines (Qwen3 does), so the stripped text is searched."""
    reasoning = message.get("reasoning_content", "").strip()
    p = text.find(reasoning, start, end) if reasoning else -1
    return (p, p + len(reasoning)) if p >= 0 else None


# ----------------------------------------------------------------------------------- one sample

def _char_mask(full: str, spans, messages: list[dict], opts: Options, eot: str, notes: Counter) -> np.ndarray:
    """True on every supervised character of `full`."""
    char_mask = np.zeros(len(full) + 1, dtype=bool)  # +1: zero-width tokens at the very end read False
    for k, a, b in spans:
        m = messages[k]
        if m.get("finish_reason") == CUT:
            b = cut_span_end(full, a, b, m["content"], eot)
            notes["cut_replies"] += 1
        char_mask[a:b] = True
        field = reasoning_field(full, a, b, m)
        if m.get("reasoning_content", "").strip() and field is None:
            notes["reasoning_content_not_rendered"] += 1
        if opts.no_reasoning_loss:
            for r0, r1 in reasoning_blocks(full, a, b) + ([field] if field else []):
                char_mask[r0:r1] = False
    return char_mask


def _splice_target_ids(tokenizer, full: str, spans, messages: list[dict], ids: list[int], starts: list[int],
                       ends: list[int], char_mask: np.ndarray, notes: Counter) -> tuple[list[int], np.ndarray]:
    """Token ids and mask with each reply's `token_ids` (what the target generated) in place of the
    re-tokenized reply text, where the template wrote the reply verbatim and the ids decode to it.
    Re-tokenizing text need not give the ids it was decoded from (a model may emit a non-canonical
    tokenization); a reply the template rewrote keeps the re-tokenized text, counted."""
    mask = char_mask[np.asarray(starts, dtype=np.int64)]
    vocab = len(tokenizer)
    for k, a, b in sorted(spans, key=lambda s: -s[1]):  # from the end: earlier token indices stay valid
        m = messages[k]
        if "token_ids" not in m or not m["content"]:
            continue
        # Checked, not decoded: a fast tokenizer's decode drops an unknown id, so the others could still match
        # the text and the id be trained. Such an id means the replies are another model's, all of them.
        if (bad := next((t for t in m["token_ids"] if t >= vocab), None)) is not None:
            raise ForeignIds(f"message {k}: token_ids hold id {bad}, outside the tokenizer's vocabulary of {vocab:,} "
                             f"ids: the replies were generated by another model (regenerate them with this "
                             f"target, or give --tokenizer the model that generated them)")
        notes["token_ids.replies"] += 1
        p = full.find(m["content"], a, b)
        q = p + len(m["content"])
        i0, i1 = bisect.bisect_left(starts, p), bisect.bisect_left(starts, q)
        if p >= 0 and ids[i0:i1] == m["token_ids"]:
            notes["token_ids.same"] += 1
            continue
        aligned = p >= 0 and i0 < i1 and starts[i0] == p and (i0 == 0 or ends[i0 - 1] <= p) and ends[i1 - 1] <= q
        if not aligned or tokenizer.decode(m["token_ids"], skip_special_tokens=False) != m["content"]:
            notes["token_ids.retokenized"] += 1
            continue
        ids = ids[:i0] + list(m["token_ids"]) + ids[i1:]
        mask = np.concatenate([mask[:i0], _ids_mask(tokenizer, m["token_ids"], char_mask[p:q]), mask[i1:]])
        notes["token_ids.spliced"] += 1
    return ids, mask


def _ids_mask(tokenizer, ids: list[int], text_mask: np.ndarray) -> np.ndarray:
    """Each id's mask: `text_mask` (over the characters `ids` decode to) at the id's first character.
    The mask changes at a few characters only (a reasoning block's edges, under --no-reasoning-loss), so
    the first id at or past each change is found by bisection (a few decodes, not one per id)."""
    first_char = lambda j: len(tokenizer.decode(ids[:j], skip_special_tokens=False))  # noqa: E731
    out = np.empty(len(ids), dtype=bool)
    changes = (np.flatnonzero(np.diff(text_mask.astype(np.int8))) + 1).tolist()
    edges = [0] + [bisect.bisect_left(range(len(ids)), c, key=first_char) for c in changes] + [len(ids)]
    for c, j0, j1 in zip([0] + changes, edges, edges[1:]):
        out[j0:j1] = text_mask[c]
    return out


def encode(tokenizer, messages: list[dict], opts: Options, eot: str,
           notes: Counter | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32) and loss mask (uint8) of one conversation; `notes` counts what was done to its
    replies (cut, target ids spliced or re-tokenized, reasoning left out by the template)."""
    notes = Counter() if notes is None else notes
    view = template_view(messages)

    def render(msgs, generation_prompt):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        full = render(view, False)
        spans = assistant_spans(render, view, full, eot, opts.last_turn_only)
    except Skip:
        raise
    except Exception as exc:  # jinja raises on templates' own checks (e.g. "roles must alternate")
        raise Skip("template_error", f"chat template failed: {type(exc).__name__}: {exc}") from exc
    char_mask = _char_mask(full, spans, messages, opts, eot, notes)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = _splice_target_ids(tokenizer, full, spans, messages, list(enc["input_ids"]),
                                   [s for s, _ in enc["offset_mapping"]], [e for _, e in enc["offset_mapping"]],
                                   char_mask, notes)
    if opts.max_length and len(ids) > opts.max_length:
        raise Skip("over_length", f"{len(ids)} tokens > --max-length {opts.max_length}")
    if not mask.any():
        raise Skip("no_supervised", "no supervised token")
    return np.asarray(ids, dtype=np.uint32), mask.astype(np.uint8)


# ----------------------------------------------------------------------------------- workers

_worker: dict[str, Any] = {}


def _init_pool_worker(tokenizer_dir: str, opts: Options) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is the parent's (Pool.terminate)
    _init_worker(tokenizer_dir, opts)


def _init_worker(tokenizer_dir: str, opts: Options) -> None:
    tok = load_tokenizer(tokenizer_dir)
    _worker.update(tokenizer=tok, opts=opts, eot=end_of_turn_marker(tok))


def _process(item: tuple[int, bytes]) -> tuple[int, str | None, Any]:
    """(line number, None, (ids, mask, notes)) for a sample, (line number, reason, message) for a skip."""
    line_no, raw = item
    try:
        _, messages = read_chat_line(raw)
        notes: Counter = Counter()
        ids, mask = encode(_worker["tokenizer"], messages, _worker["opts"], _worker["eot"], notes)
        return line_no, None, (ids, mask, notes)
    except Skip as skip:
        return line_no, skip.reason, str(skip)
    except ForeignIds as exc:
        return line_no, FATAL, str(exc)
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
    for line_no, raw in numbered_lines(path):
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
    replies: Counter = Counter()
    kept = lines = 0
    total_bytes = max(src.stat().st_size, 1)
    t0 = time.monotonic()
    init = (tokenizer_dir, opts)
    # fork: workers inherit the imported modules (importing transformers costs seconds per process)
    # and load their own tokenizer; the parent has not run the tokenizer's thread pool, so fork is safe.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, _init_pool_worker, init) if workers > 1 else None
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
                    if reason == FATAL:
                        raise InputError(f"{src}:{line_no}: {payload}")
                    if reason is None:
                        writer.add(*payload[:2])
                        replies.update(payload[2])
                        kept += 1
                        continue
                    _count_skip(skipped, reason, f"{src}:{line_no}", payload)
                bar.update(block_bytes, lines=lines, kept=kept, skipped=lines - kept)
            if kept == 0:
                raise ValueError(f"{src}: no usable sample in {lines} lines (skipped: {skipped})")
            meta = _meta(tok, tokenizer_dir, src, lines, opts, skipped, replies)
            writer.commit(meta)
    except BaseException:
        if pool is not None:
            pool.terminate()  # not close(): the queued lines would be tokenized first (a SIGTERM waits for them)
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    meta.update(num_samples=writer.num_samples, num_tokens=writer.num_tokens,
                num_supervised_tokens=writer.num_supervised, vocab_size=writer.vocab_size)
    _log_summary(meta, lines, time.monotonic() - t0)
    return meta


def _count_skip(skipped: dict[str, int], reason: str, where: str, why: Any) -> None:
    """Count a skipped line by its reason; log the first LOGGED_PER_REASON of each reason (blank lines
    are only counted), the rest at DEBUG."""
    skipped[reason] += 1
    if reason == "blank_line":
        return
    level = logging.WARNING if skipped[reason] <= LOGGED_PER_REASON else logging.DEBUG
    log.log(level, "%s: skipped (%s): %s", where, reason, why)
    if skipped[reason] == LOGGED_PER_REASON:
        log.warning("further '%s' lines are logged at DEBUG level only", reason)


def _meta(tok, tokenizer_dir: str, src: Path, lines: int, opts: Options, skipped: dict[str, int],
          replies: Counter) -> dict[str, Any]:
    """meta.json's record of how the data set was made (the writer adds its counts)."""
    return {
        "tokenizer": str(Path(tokenizer_dir).absolute()),
        "tokenizer_name": getattr(tok, "name_or_path", ""),
        "max_length": opts.max_length or None,
        "skipped": skipped,
        "replies": reply_notes(replies),
        "made_by": {
            "tool": "dflash_dist.data.prepare",
            "input": str(src.absolute()),
            "input_lines": lines,
            "options": asdict(opts),
            "end_of_turn_marker": end_of_turn_marker(tok),
            "supervision": "assistant content + end-of-turn marker (none after a reply cut at its token limit); "
                           "generation prompt and trailing whitespace excluded; a reply's token_ids replace its "
                           "re-tokenized text" + ("; <think> blocks and reasoning_content excluded"
                                                  if opts.no_reasoning_loss else ""),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    }


def _log_summary(meta: dict[str, Any], lines: int, seconds: float) -> None:
    r = meta["replies"]
    log.info("prepare: %d lines -> %d samples, %d tokens (%d supervised) in %.1f s; skipped %s; replies %s",
             lines, meta["num_samples"], meta["num_tokens"], meta["num_supervised_tokens"], seconds,
             {k: v for k, v in meta["skipped"].items() if v}, r)
    if r["token_ids_retokenized"]:
        log.warning("%d replies carry token_ids the chat template does not write verbatim (it rewrote the reply, "
                    "or the ids are another tokenizer's): their re-tokenized text was trained instead",
                    r["token_ids_retokenized"])
    if r["reasoning_content_not_rendered"]:
        log.warning("%d assistant turns have a reasoning_content the chat template did not render (not trained)",
                    r["reasoning_content_not_rendered"])


REPLY_NOTES = ("cut_replies", "token_ids.replies", "token_ids.same", "token_ids.spliced", "token_ids.retokenized",
               "reasoning_content_not_rendered")


def reply_notes(counts: Counter) -> dict[str, int]:
    """meta.json's "replies": every count, zeros included, so a reader need not guess what was checked."""
    return {k.replace(".", "_"): int(counts.get(k, 0)) for k in REPLY_NOTES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.data.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory (with a chat template)")
    ap.add_argument("--input", required=True, help="JSONL file of conversations")
    ap.add_argument("--output", required=True, help="dataset directory to create")
    ap.add_argument("--max-length", type=int, default=0, help="skip (and count) samples with more tokens")
    ap.add_argument("--last-turn-only", action="store_true", help="supervise only the last assistant turn")
    ap.add_argument("--no-reasoning-loss", action="store_true",
                    help="leave <think> blocks and rendered reasoning_content out of the loss")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.max_length < 0 or args.workers < 1:
        ap.error("--max-length must be >= 0 and --workers >= 1")
    opts = Options(max_length=args.max_length, last_turn_only=args.last_turn_only,
                   no_reasoning_loss=args.no_reasoning_loss)
    terminate_cleanly()  # a SIGTERM unwinds: the half-written --output is removed
    try:
        meta = prepare(args.tokenizer, args.input, args.output, opts, workers=args.workers,
                       overwrite=args.overwrite)
    except InputError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    except (OSError, ValueError, ImportError) as exc:
        log.error("%s", exc)
        return 1
    # The command's result, one JSON line on stdout for scripts; progress and diagnostics go to logging.
    sys.stdout.write(json.dumps({k: meta[k] for k in ("num_samples", "num_tokens", "num_supervised_tokens",
                                                       "skipped")}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
