"""Tokenize chat data into the on-disk dataset, supervising only the assistant's tokens, as the target
writes them under the template and arguments it is served with.

    python -m dflash_dist.data.prepare --tokenizer DIR --input FILE[:WEIGHT] [--input ...] --output DIR \
        [--max-length N | --target-config DIR] [--enable-thinking | --no-thinking] [--chat-template-kwargs JSON]
        [--chat-template FILE] [--no-split-turns] [--heldout N] [--dedup] [--seed N] [--last-turn-only]
        [--no-reasoning-loss] [--workers N] [--overwrite]

Records are read by data.jsonl (the reader regeneration and evaluation use: the same skip reasons for the
same line): OpenAI `messages` or ShareGPT `conversations` (from/value or role/content), with reasoning,
tool calls, tool results and a line's `tools`, or pre-tokenized rows {"input_ids", "loss_mask"}, which
are written exactly as given (checked against the vocabulary and --max-length). data.render turns a
conversation into samples: one per assistant turn the template rewrites once the conversation goes on
(a reasoning template drops past turns' reasoning), one for a template that renders every turn verbatim
(--no-split-turns: always one). An assistant message may carry
  * reasoning (reasoning_content, or an inline <think> block): trained where the template renders it; a
    turn whose reasoning the template leaves out of its own sample is counted in meta.json ("replies");
  * tool_calls: supervised as the template writes them; tool messages are context, never supervised;
  * weight 0: context, not supervised (OpenAI fine-tuning; a leading assistant greeting);
  * token_ids (data.regenerate writes them): the ids the target generated, trained in place of the
    re-tokenized reply where the template writes the reply verbatim and the ids decode to it; elsewhere
    the re-tokenized text is trained and the reply counted as retokenized. An id outside the tokenizer's
    vocabulary is exit 2 naming the file and line: the replies are another model's;
  * finish_reason "length" (a reply cut at its token limit): supervised without the end-of-turn marker
    the template writes after it, since the target never ended that turn.
--no-reasoning-loss unmarks every <think>...</think> block and the rendered reasoning of a turn.

Inputs mix (data.mixture): each --input is drawn WEIGHT times per line in expectation (seeded), counted per
source in meta.json ("sources") and the closing summary; --heldout N writes N whole conversations to
OUTPUT/heldout.jsonl as prompts for `train.eval_bench`; exact duplicates are counted (dropped under --dedup).

Samples longer than --max-length (default: the target's max_position_embeddings, from --target-config or the
tokenizer directory's config.json) are skipped and counted, never truncated; malformed lines are logged with
their line numbers, skipped and counted ("skipped" in meta.json). The output appears whole or not at all
(data.disk's DatasetWriter); SIGTERM removes the half-written one (exit 143), and a rerun removes what a
killed run left. Exit 2: input the run cannot use (a flag, a file, another model's token ids).
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_dist.data.disk import DatasetWriter
from dflash_dist.data.jsonl import (  # noqa: F401
    CUT,
    LINE_SKIPS,
    Conversation,
    Skip,
    Tokenized,
    numbered_lines,
    parse_messages,
    read_chat_line,
    read_record,
    template_view,
)
from dflash_dist.data.mixture import (
    HELDOUT,
    Draws,
    Selection,
    Source,
    SourceCounts,
    SourceError,
    check_sources,
    choose_heldout,
    conversation_key,
    heldout_line,
    heldout_turns,
    parse_source,
)
from dflash_dist.data.prepare_args import options, parser
from dflash_dist.data.records import InputError, iter_records  # InputError: exit 2 (re-exported)
from dflash_dist.data.render import (  # noqa: F401
    THINK_CLOSE,
    THINK_OPEN,
    ForeignIds,
    Options,
    assistant_spans,
    encode,
    end_of_turn_marker,
    plan_samples,
    reasoning_blocks,
    renderer,
    supervised_turns,
    template_failure,
)
from dflash_dist.exits import EXIT_BAD_INPUT
from dflash_dist.io.files import terminate_cleanly
from dflash_dist.observe.bars import Bar

log = logging.getLogger(__name__)

SKIP_REASONS = LINE_SKIPS + ("template_error", "span_not_found", "no_supervised", "over_length")
LOGGED_PER_REASON = 20  # warnings shown per reason; the rest go to DEBUG (the counts stay exact)
FATAL = "fatal"  # a line that makes the whole input wrong (not one of SKIP_REASONS): the run stops


# ----------------------------------------------------------------------------------- workers

_worker: dict[str, Any] = {}


@dataclass
class Kept:
    """What one line gave: its samples, what was done to its replies, the samples of it that were skipped
    (a split turn over --max-length: the line's other samples stay) and its duplicate key."""
    samples: list[tuple[np.ndarray, np.ndarray]]
    notes: Counter
    partial: list[tuple[str, str]] = field(default_factory=list)
    key: bytes = b""
    left_out: list[str] = field(default_factory=list)  # the samples whose reasoning the template did not render


def _init_pool_worker(tokenizer_dir: str, opts: Options) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is the parent's (Pool.terminate)
    _init_worker(tokenizer_dir, opts)


def _init_worker(tokenizer_dir: str, opts: Options) -> None:
    tok = load_tokenizer(tokenizer_dir, opts.chat_template)
    _worker.update(tokenizer=tok, opts=opts, eot=end_of_turn_marker(tok))


def conversation_samples(tok, conv: Conversation, opts: Options, eot: str) -> Kept:
    """The samples of one conversation (data.render's plan), each encoded by `encode`. A sample that is
    skipped (over --max-length) costs that sample; the line is skipped when none is left."""
    view = template_view(conv.messages)
    plan = plan_samples(renderer(tok, opts, conv.tools), view, supervised_turns(conv.messages, opts.last_turn_only),
                        opts.split_turns)
    kept = Kept([], Counter(conv.notes), key=conversation_key(conv.messages, conv.tools))
    skips: list[Skip] = []
    for end, turns in plan:
        notes: Counter = Counter()
        try:
            kept.samples.append(encode(tok, conv.messages[:end + 1], opts, eot, notes, tools=conv.tools, turns=turns))
            kept.notes.update(notes)  # a skipped sample's notes are not the data set's
            if notes["reasoning_left_out"]:
                kept.left_out.append(f"the sample ending at message {end}: the chat template left out the reasoning "
                                     f"of {notes['reasoning_left_out']} assistant turn(s) (not trained)")
            if notes["tool_calls_not_rendered"]:
                kept.left_out.append(f"the sample ending at message {end}: the chat template did not write the tool "
                                     f"calls of {notes['tool_calls_not_rendered']} assistant turn(s) (those turns "
                                     "not trained; give --chat-template a template that renders tool calls)")
        except Skip as skip:
            skips.append(skip)
            kept.partial.append((skip.reason, f"the sample ending at message {end}: {skip}"))
    if not kept.samples:
        raise skips[0] if skips else Skip("no_supervised", "no supervised token")
    if len(plan) > 1:
        kept.notes["split_conversations"] += 1
        kept.notes["split_samples"] += len(kept.samples)
    return kept


def tokenized_sample(row: Tokenized, vocab: int, max_length: int) -> Kept:
    """A pre-tokenized row, exactly as given: its ids must be this tokenizer's, its length within bounds."""
    if (bad := next((t for t in row.input_ids if t >= vocab), None)) is not None:
        raise ForeignIds(f"input_ids hold id {bad}, outside the tokenizer's vocabulary of {vocab:,} ids: the row "
                         f"was tokenized by another model's tokenizer")
    if max_length and len(row.input_ids) > max_length:
        raise Skip("over_length", f"{len(row.input_ids)} tokens > --max-length {max_length}")
    if not any(row.loss_mask):
        raise Skip("no_supervised", "no supervised token (loss_mask is all 0)")
    ids, mask = np.asarray(row.input_ids, dtype=np.uint32), np.asarray(row.loss_mask, dtype=np.uint8)
    key = conversation_key([row.input_ids, row.loss_mask], None)
    return Kept([(ids, mask)], Counter({"pretokenized_rows": 1}), key=key)


def _process(item: tuple[int, str, Any]) -> tuple[int, str, str | None, Any]:
    """(source, where, None, Kept) for a kept line, (source, where, reason, message) for a skip."""
    src, line_no, raw = item
    tok, opts = _worker["tokenizer"], _worker["opts"]
    try:
        rec = read_record(raw)
        if isinstance(rec, Tokenized):
            return src, line_no, None, tokenized_sample(rec, len(tok), opts.max_length)
        return src, line_no, None, conversation_samples(tok, rec, opts, _worker["eot"])
    except Skip as skip:
        return src, line_no, skip.reason, str(skip)
    except ForeignIds as exc:
        return src, line_no, FATAL, str(exc)
    except Exception as exc:  # whatever else one line makes the tokenizer raise costs that line, not the run
        return src, line_no, "unexpected_error", f"{type(exc).__name__}: {exc}"


def load_tokenizer(path: str, chat_template: str = ""):
    try:
        from transformers import AutoTokenizer  # optional extra: only preparing data needs it
    except ImportError as exc:
        raise ImportError("dflash_dist.data.prepare needs transformers: pip install 'dflash_dist[hf]'") from exc
    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path}: a fast tokenizer is required (character offsets map spans to tokens)")
    if chat_template:
        tok.chat_template = Path(chat_template).read_text()  # checked readable by main before any work
    if not tok.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat_template (give one with --chat-template FILE)")
    return tok




# ----------------------------------------------------------------------------------- driver

@dataclass
class _Tally:
    """The counts of a prepare, per source and in all."""
    sources: list[SourceCounts]
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    replies: Counter = field(default_factory=Counter)
    seen: set = field(default_factory=set)  # the keys of the conversations kept so far
    held: set = field(default_factory=set)  # the keys of the held-out conversations: a copy is never trained
    heldout: list[str] = field(default_factory=list)  # heldout.jsonl's lines
    lines: int = 0
    kept: int = 0
    logged: dict[str, int] = field(default_factory=dict)  # warnings logged per kind


def _sources(inputs: str | Source | list) -> list[Source]:
    items = inputs if isinstance(inputs, list) else [inputs]
    return [s if isinstance(s, Source) else parse_source(str(s)) for s in items]


def _pick_heldout(sources: list[Source], sel: Selection) -> tuple[set[tuple[int, str, int]], set[bytes]]:
    """The held-out (source, file, line) places and their conversations' keys: --heldout of the distinct
    conversations a prompt file can replay, seeded (a copy of a held-out conversation elsewhere is never
    trained either). Read once more for it (parsing only, no tokenizer)."""
    first: dict[bytes, tuple[int, str, int]] = {}
    for i, src in enumerate(sources):
        for file, line_no, raw in iter_records(src.path):
            try:
                rec = read_record(raw)
            except Skip:
                continue
            key = conversation_key(rec.messages, rec.tools) if isinstance(rec, Conversation) else None
            if key is not None and key not in first and heldout_turns(rec.messages):
                first[key] = (i, file, line_no)
    chosen = choose_heldout(list(first.values()), sel.heldout, sel.seed)
    return chosen, {key for key, where in first.items() if where in chosen}


def _items(sources: list[Source], sel: Selection, heldout: set, tally: _Tally, size: int) -> Iterator[list]:
    """Blocks of (source, "file:line", raw, copies) to tokenize, `size` at a time (memory stays bounded):
    held-out lines go to heldout.jsonl, lines drawn 0 times are only counted, a line drawn n times is sent
    once."""
    block: list = []
    for i, src in enumerate(sources):
        draws = Draws(src.weight, sel.seed, i)
        counts = tally.sources[i]
        for file, line_no, raw in iter_records(src.path):
            counts.lines += 1
            tally.lines += 1
            where = f"{file}:{line_no}"
            n = draws.next()  # drawn for every line, so line i's copies depend on the seed and i alone
            if (i, file, line_no) in heldout:
                tally.heldout.append(heldout_line(heldout_turns(read_record(raw).messages), where))
                counts.heldout += 1
                continue
            if n == 0:
                counts.not_drawn += 1
                continue
            block.append((i, where, raw, n))
            if len(block) == size:
                yield block
                block = []
    if block:
        yield block


def _take(tally: _Tally, writer: DatasetWriter, sel: Selection, src_i: int, where: str, copies: int,
          reason: str | None, payload: Any) -> None:
    """One tokenized line (`where`: file:line) into the counts and (drawn `copies` times) the data set."""
    counts = tally.sources[src_i]
    if reason == FATAL:
        raise InputError(f"{where}: {payload}")
    if reason is not None:
        _count_skip(tally.skipped, reason, where, payload, counts)
        return
    for r, why in payload.partial:
        _count_skip(tally.skipped, r, where, why, counts)
    if payload.key in tally.seen or payload.key in tally.held:
        counts.duplicates += 1
        if sel.dedup or payload.key in tally.held:
            return
    tally.seen.add(payload.key)
    for why in payload.left_out:
        _log_capped(tally, "reasoning_left_out", f"{where}: {why}")
    tally.replies.update(payload.notes)
    tally.kept += 1
    counts.kept_lines += 1
    for _ in range(copies):
        for ids, mask in payload.samples:
            writer.add(ids, mask)
            counts.draws += 1
            counts.tokens += len(ids)
            counts.supervised_tokens += int(np.count_nonzero(mask))
    counts.samples += len(payload.samples)


def _input_bytes(sources: list[Source]) -> int | None:
    """The progress bar's total: the bytes of the JSONL lines (a parquet row is not counted in bytes)."""
    if any(not Path(s.path).is_file() or Path(s.path).suffix == ".parquet" for s in sources):
        return None
    return max(sum(Path(s.path).stat().st_size for s in sources), 1)


def prepare(tokenizer_dir: str, input_path: str | Source | list, output_dir: str, opts: Options, *,
            workers: int = 1, overwrite: bool = False, progress_s: float = 10.0,
            selection: Selection = Selection()) -> dict[str, Any]:
    """Tokenize the inputs (a path, `FILE:WEIGHT`, a Source, or a list of them) into `output_dir`
    (atomically). Returns the meta written to meta.json."""
    sources = _sources(input_path)
    check_sources(sources)
    if Path(output_dir).exists() and not overwrite:  # before the slow transformers import
        raise FileExistsError(f"{output_dir} already exists (pass --overwrite to replace it)")
    tok = load_tokenizer(tokenizer_dir, opts.chat_template)
    heldout, held_keys = _pick_heldout(sources, selection) if selection.heldout else (set(), set())
    tally = _Tally([SourceCounts(s.path, s.weight) for s in sources], held=held_keys)
    t0 = time.monotonic()
    init = (tokenizer_dir, opts)
    # fork: workers inherit the imported modules (importing transformers costs seconds per process)
    # and load their own tokenizer; the parent has not run the tokenizer's thread pool, so fork is safe.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = mp.get_context(method).Pool(workers, _init_pool_worker, init) if workers > 1 else None
    if pool is None:
        _init_worker(*init)
    name = sources[0].path if len(sources) == 1 else f"{len(sources)} sources"
    try:
        with DatasetWriter(output_dir, vocab_size=len(tok), overwrite=overwrite) as writer, \
                Bar(_input_bytes(sources), f"prepare {Path(name).name}", "B", unit_scale=True,
                    every_s=progress_s, logger=log) as bar:
            for block in _items(sources, selection, heldout, tally, max(1, workers) * 512):
                copies = {(i, n): c for i, n, _, c in block}
                work = [(i, n, raw) for i, n, raw, _ in block]
                results = pool.imap(_process, work, chunksize=32) if pool else map(_process, work)
                for src_i, where, reason, payload in results:
                    _take(tally, writer, selection, src_i, where, copies[src_i, where], reason, payload)
                bar.update(sum(len(raw) for _, _, raw in work if isinstance(raw, bytes)), lines=tally.lines, kept=tally.kept, skipped=sum(tally.skipped.values()))
            if tally.kept == 0:
                raise ValueError(f"{name}: no usable sample in {tally.lines} lines (skipped: {tally.skipped})")
            if tally.heldout:
                _write_heldout(writer.tmp / HELDOUT, tally.heldout)
            meta = _meta(tok, tokenizer_dir, sources, opts, selection, tally)
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
    _log_summary(meta, tally.lines, time.monotonic() - t0)
    return meta


def _log_capped(tally: _Tally, kind: str, text: str) -> None:
    """A WARNING for the first LOGGED_PER_REASON of a kind, DEBUG after (the counts stay exact)."""
    n = tally.logged[kind] = tally.logged.get(kind, 0) + 1
    log.log(logging.WARNING if n <= LOGGED_PER_REASON else logging.DEBUG, "%s", text)


def _write_heldout(path: Path, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def _count_skip(skipped: dict[str, int], reason: str, where: str, why: Any, counts: SourceCounts | None = None) -> None:
    """Count a skipped line by its reason; log the first LOGGED_PER_REASON of each reason (blank lines
    are only counted), the rest at DEBUG."""
    skipped[reason] += 1
    if counts is not None:
        counts.skipped[reason] = counts.skipped.get(reason, 0) + 1
    if reason == "blank_line":
        return
    level = logging.WARNING if skipped[reason] <= LOGGED_PER_REASON else logging.DEBUG
    log.log(level, "%s: skipped (%s): %s", where, reason, why)
    if skipped[reason] == LOGGED_PER_REASON:
        log.warning("further '%s' lines are logged at DEBUG level only", reason)


def _meta(tok, tokenizer_dir: str, sources: list[Source], opts: Options, sel: Selection,
          tally: _Tally) -> dict[str, Any]:
    """meta.json's record of how the data set was made (the writer adds its counts)."""
    reader = {k: v for k, v in sorted(tally.replies.items()) if k not in REPLY_NOTES}
    return {
        "tokenizer": str(Path(tokenizer_dir).absolute()),
        "tokenizer_name": getattr(tok, "name_or_path", ""),
        "max_length": opts.max_length or None,
        "skipped": tally.skipped,
        "replies": reply_notes(tally.replies),
        "read": reader,  # what the reader mapped or left out (roles, reasoning fields, unknown keys, ...)
        "sources": [asdict(c) for c in tally.sources],
        "heldout": {"conversations": len(tally.heldout), "file": HELDOUT if tally.heldout else None},
        "duplicates": sum(c.duplicates for c in tally.sources),
        "made_by": {
            "tool": "dflash_dist.data.prepare",
            "input": str(Path(sources[0].path).absolute()),
            "inputs": [{"path": str(Path(s.path).absolute()), "weight": s.weight} for s in sources],
            "input_lines": tally.lines,
            "options": asdict(opts),
            "selection": asdict(sel),
            "end_of_turn_marker": end_of_turn_marker(tok),
            "supervision": "assistant content and tool calls + end-of-turn marker (none after a reply cut at its "
                           "token limit); generation prompt, tool results, weight-0 turns and trailing whitespace "
                           "excluded; a reply's token_ids replace its re-tokenized text; "
                           + ("a sample per assistant turn the template rewrites later" if opts.split_turns
                              else "one sample per conversation")
                           + ("; <think> blocks and reasoning excluded" if opts.no_reasoning_loss else ""),
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    }


def _log_summary(meta: dict[str, Any], lines: int, seconds: float) -> None:
    r = meta["replies"]
    log.info("prepare: %d lines -> %d samples, %d tokens (%d supervised) in %.1f s; skipped %s; replies %s",
             lines, meta["num_samples"], meta["num_tokens"], meta["num_supervised_tokens"], seconds,
             {k: v for k, v in meta["skipped"].items() if v}, r)
    for s in meta["sources"]:
        log.info("source %s (weight %g): %d lines, %d kept, %d samples written (repeats included), %d tokens "
                 "(%d supervised), %d held out, %d duplicates, skipped %s", s["path"], s["weight"], s["lines"],
                 s["kept_lines"], s["draws"], s["tokens"], s["supervised_tokens"], s["heldout"], s["duplicates"],
                 s["skipped"])
    if r["token_ids_retokenized"]:
        log.warning("%d replies carry token_ids the chat template does not write verbatim (it rewrote the reply, "
                    "or the ids are another tokenizer's): their re-tokenized text was trained instead",
                    r["token_ids_retokenized"])
    if r["reasoning_left_out"]:
        log.warning("%d assistant turns have reasoning the chat template did not render in their own sample "
                    "(not trained; see replies.reasoning_left_out)", r["reasoning_left_out"])
    if r["tool_calls_not_rendered"]:
        log.warning("%d assistant turns hold tool calls the chat template did not write (those turns not trained; "
                    "see replies.tool_calls_not_rendered; --chat-template FILE gives a template that renders "
                    "them)", r["tool_calls_not_rendered"])


REPLY_NOTES = ("cut_replies", "token_ids.replies", "token_ids.same", "token_ids.spliced", "token_ids.retokenized",
               "reasoning_content_not_rendered", "reasoning_turns", "reasoning_left_out", "reasoning_tokens",
               "tool_call_turns", "tool_calls_not_rendered", "split_conversations", "split_samples",
               "pretokenized_rows")


def reply_notes(counts: Counter) -> dict[str, int]:
    """meta.json's "replies": every count, zeros included, so a reader need not guess what was checked."""
    return {k.replace(".", "_"): int(counts.get(k, 0)) for k in REPLY_NOTES}


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    terminate_cleanly()  # a SIGTERM unwinds: the half-written --output is removed
    try:
        opts, sel = options(args)
        meta = prepare(args.tokenizer, args.input, args.output, opts, workers=args.workers,
                       overwrite=args.overwrite, selection=sel)
    except (InputError, SourceError) as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    except (OSError, ValueError, ImportError) as exc:
        log.error("%s", exc)
        return 1
    # The command's result, one JSON line on stdout for scripts; progress and diagnostics go to logging.
    out = {k: meta[k] for k in ("num_samples", "num_tokens", "num_supervised_tokens", "skipped", "duplicates")}
    out["heldout"] = meta["heldout"]["conversations"]
    out["sources"] = [{k: s[k] for k in ("path", "weight", "lines", "kept_lines", "draws", "supervised_tokens")}
                      for s in meta["sources"]]
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
