"""data.prepare's flags -> its Options (data.render) and Selection (data.mixture), each refusal naming its
flag (SourceError: exit 2): template arguments as the target is served with (--enable-thinking/--no-thinking
folded into --chat-template-kwargs, a contradiction refused), and --max-length bounded by the target's
context (max_position_embeddings from --target-config, or the tokenizer directory's config.json)."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from dflash_dist.data.mixture import Selection, SourceError
from dflash_dist.data.render import Options

log = logging.getLogger("dflash_dist.data.prepare")


def target_context(path: str | None) -> tuple[int, str] | None:
    """(max_position_embeddings, the file it was read from) of a target config (a directory holding
    config.json, or the file), or None when there is none to read."""
    if not path:
        return None
    f = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not f.is_file():
        return None
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError(f"{f}: cannot read the target's config ({exc})") from exc
    n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return (int(n), str(f)) if n else None


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.data.prepare", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory (with a chat template)")
    ap.add_argument("--input", required=True, action="append",
                    help="FILE or FILE:WEIGHT (JSONL, parquet, a `datasets` directory, a directory of them); "
                         "repeat to mix sources: WEIGHT is the expected draws of each line (default 1)")
    ap.add_argument("--output", required=True, help="dataset directory to create")
    ap.add_argument("--max-length", type=int, default=None,
                    help="skip (and count) samples with more tokens (default: the target's max_position_embeddings "
                         "when --target-config or the tokenizer directory's config.json gives it, else no limit)")
    ap.add_argument("--target-config", help="the target's directory (or config.json): its context bounds samples")
    think = ap.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="thinking", action="store_true", default=None,
                       help="pass enable_thinking=true to the chat template (Qwen3-style)")
    think.add_argument("--no-thinking", dest="thinking", action="store_false",
                       help="pass enable_thinking=false to the chat template: a reply is supervised from its first "
                            "written token (the template's empty <think></think> is prompt)")
    ap.add_argument("--chat-template-kwargs", default="{}", help="JSON object of more chat-template arguments")
    ap.add_argument("--chat-template", default="", help="a Jinja chat template file to use instead of the tokenizer's")
    ap.add_argument("--no-split-turns", action="store_true",
                    help="one sample per conversation even where the template rewrites past turns (their "
                         "reasoning is then lost, counted as reasoning_left_out)")
    ap.add_argument("--heldout", type=int, default=0, help="hold out N whole conversations as OUTPUT/heldout.jsonl")
    ap.add_argument("--dedup", action="store_true", help="drop exact duplicate conversations (always counted)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weighted draws and of the held-out choice")
    ap.add_argument("--last-turn-only", action="store_true", help="supervise only the last assistant turn")
    ap.add_argument("--no-reasoning-loss", action="store_true",
                    help="leave <think> blocks and rendered reasoning out of the loss")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return ap


def template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-kwargs with --enable-thinking/--no-thinking folded in (a contradiction refused)."""
    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as exc:
        raise SourceError(f"--chat-template-kwargs: not JSON ({exc})") from exc
    if not isinstance(kwargs, dict):
        raise SourceError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    if args.thinking is not None:
        if kwargs.get("enable_thinking", args.thinking) != args.thinking:
            raise SourceError(f"--chat-template-kwargs sets enable_thinking={kwargs['enable_thinking']} but "
                              f"{'--enable-thinking' if args.thinking else '--no-thinking'} is given")
        kwargs["enable_thinking"] = args.thinking
    return kwargs


def max_length(args: argparse.Namespace) -> int:
    """--max-length, defaulting to the target's context; one past the target's context is refused (a
    sample must never be trained past the target's positions)."""
    if args.target_config and target_context(args.target_config) is None:
        raise SourceError(f"--target-config {args.target_config}: no config.json with max_position_embeddings")
    ctx = target_context(args.target_config or args.tokenizer)
    if args.max_length is None:
        if ctx:
            log.info("--max-length %d: the target's max_position_embeddings (%s)", *ctx)
        return ctx[0] if ctx else 0
    if ctx and (args.max_length == 0 or args.max_length > ctx[0]):
        raise SourceError(f"--max-length {args.max_length or 'unlimited'} exceeds the target's "
                          f"max_position_embeddings {ctx[0]} ({ctx[1]}): samples would be trained past the "
                          f"target's positions")
    return args.max_length


def options(args: argparse.Namespace) -> tuple[Options, Selection]:
    for flag, v in (("--max-length", args.max_length or 0), ("--heldout", args.heldout), ("--seed", args.seed)):
        if v < 0:
            raise SourceError(f"{flag} must be >= 0, got {v}")
    if args.workers < 1:
        raise SourceError(f"--workers must be >= 1, got {args.workers}")
    if args.chat_template and not Path(args.chat_template).is_file():
        raise SourceError(f"--chat-template {args.chat_template}: no such file")
    opts = Options(max_length=max_length(args), last_turn_only=args.last_turn_only,
                   no_reasoning_loss=args.no_reasoning_loss, split_turns=not args.no_split_turns,
                   template_kwargs=template_kwargs(args), chat_template=args.chat_template)
    return opts, Selection(heldout=args.heldout, dedup=args.dedup, seed=args.seed)
