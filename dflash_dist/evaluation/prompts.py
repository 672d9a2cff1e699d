"""Prompt sets: token-id files, conversations as text, and the named public benchmarks.

A file given to `--bench` (or `--prompts`) is JSONL, one prompt per line, either
  - token ids: a list of ints, or {"input_ids": [...]} (or "prompt_ids"): decoded as they are, for a
    fixed number of new tokens (no chat template, no stop token);
  - a conversation: {"turns": ["first user message", "second", ...]}, the format of z-lab's benchmark
    caches: each turn is sent as a user message after the target's previous answers, through the
    target's chat template, and the answer ends at the target's end-of-turn token.
A NAME (gsm8k, math500, humaneval, mbpp, mt-bench) is the public set, with the prompt wording of z-lab's
published benchmark (dflash/benchmark.py in github.com/z-lab/dflash), loaded by the Hugging Face
`datasets` library and cached as BENCH_DIR/NAME.jsonl in the conversation format; where `datasets` is
missing or the Hub unreachable, the error names the file to provide instead.
Every bad input is an `EvalInputError` naming the file and line (the command exits 2). Lines are read
by data.jsonl, the reader prepare and regeneration use: split on "\n" alone (a raw U+2028 inside a
JSON string is text, not a line end), numbered exactly, a bad line named with the same reason.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash_dist.data.jsonl import Skip, check_text, decode_line, numbered_lines
from dflash_dist.data.sources import humaneval_turns
from dflash_dist.io.files import atomic_write


class EvalInputError(ValueError):
    """A prompt file, flag or export the evaluation cannot use; the message names which (exit 2)."""


@dataclass
class PromptSet:
    name: str
    source: str  # the file it was read from (named in errors)
    kind: str  # "ids" or "turns"
    items: list = field(default_factory=list)  # list[list[int]] (ids) or list[list[str]] (turns)
    lines: list[int] = field(default_factory=list)  # the file line of each item

    def limit(self, n: int | None) -> "PromptSet":
        """The first n prompts (all when n is None)."""
        if n is None:
            return self
        return PromptSet(self.name, self.source, self.kind, self.items[:n], self.lines[:n])

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must index the target's embedding: a negative or too large id is named by line."""
        if self.kind != "ids":
            return
        for item, line in zip(self.items, self.lines):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise EvalInputError(f"{self.source}:{line}: token id {bad[0]} outside the target's vocabulary "
                                     f"[0, {vocab_size})")


def _item(raw, where: str) -> tuple[str, list]:
    """(kind, prompt) of one parsed line."""
    if isinstance(raw, dict) and "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise EvalInputError(f"{where}: \"turns\" must be a non-empty list of non-empty strings")
        try:
            return "turns", [check_text(t, f"turn {i + 1}") for i, t in enumerate(turns)]
        except Skip as skip:
            raise EvalInputError(f"{where}: {skip.reason}: {skip}") from skip
    if isinstance(raw, dict):
        raw = raw.get("input_ids", raw.get("prompt_ids"))
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return "ids", list(raw)
    raise EvalInputError(f"{where}: expected {{\"turns\": [\"...\", ...]}}, a non-empty list of token ids, or "
                         "{\"input_ids\": [...]}")


def read_prompt_file(path: str | Path, name: str | None = None) -> PromptSet:
    """One JSONL file (module docstring); one kind per file. Empty lines are allowed, an empty file is not."""
    path = Path(path)
    pset = PromptSet(name or path.stem, str(path), "")
    try:
        for k, line in numbered_lines(path):
            try:
                raw = decode_line(line)
            except Skip as skip:
                if skip.reason == "blank_line":
                    continue
                raise EvalInputError(f"{path}:{k}: {skip.reason}: {skip}") from skip
            _add(pset, *_item(raw, f"{path}:{k}"), k)
    except OSError as exc:
        raise EvalInputError(f"{path}: cannot read the prompt file ({exc})") from exc
    if not pset.items:
        raise EvalInputError(f"{path}: no prompts in the file")
    return pset


def _add(pset: PromptSet, kind: str, prompt: list, k: int) -> None:
    """Line k's prompt into the set, which holds one kind."""
    if pset.kind and kind != pset.kind:
        raise EvalInputError(f"{pset.source}:{k}: a {kind} line in a file of {pset.kind} prompts (one kind per file)")
    pset.kind = kind
    pset.items.append(prompt)
    pset.lines.append(k)


# Public sets and the wording z-lab's benchmark sends (dflash/benchmark.py, github.com/z-lab/dflash):
# (datasets.load_dataset arguments, split, how a row becomes its list of turns).
_STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
BENCHMARKS = {
    "gsm8k": (("openai/gsm8k", "main"), "test", lambda r: [r["question"] + _STEP_BY_STEP]),
    "math500": (("HuggingFaceH4/MATH-500",), "test", lambda r: [r["problem"] + _STEP_BY_STEP]),
    "humaneval": (("openai/openai_humaneval",), "test", humaneval_turns),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", lambda r: [r["prompt"]]),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", lambda r: list(r["prompt"])),
}


def default_bench_dir() -> Path:
    return Path(os.environ.get("DFLASH_BENCH_DIR", Path.home() / ".cache" / "dflash_dist" / "benchmarks"))


def _download(name: str, out: Path) -> None:
    args, split, turns = BENCHMARKS[name]
    hint = (f"provide {out} (one {{\"turns\": [\"...\"]}} per line; z-lab's benchmark cache of {name} has this "
            "format), or install `datasets` where the Hugging Face Hub is reachable")
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise EvalInputError(f"--bench {name}: the `datasets` library is not installed: {hint}") from exc
    try:
        rows = load_dataset(*args, split=split)
        lines = [json.dumps({"turns": turns(r)}) for r in rows]
    except Exception as exc:  # offline, gated, renamed: whatever the Hub says, the way out is the same
        raise EvalInputError(f"--bench {name}: cannot load {args[0]} ({type(exc).__name__}: {exc}): {hint}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "\n".join(lines) + "\n")


def load_bench(spec: str, bench_dir: Path) -> PromptSet:
    """`--bench FILE` or `--bench NAME` (module docstring)."""
    path = Path(spec)
    if path.is_file():
        return read_prompt_file(path)
    if spec in BENCHMARKS:
        cached = bench_dir / f"{spec}.jsonl"
        if not cached.is_file():
            _download(spec, cached)
        return read_prompt_file(cached, name=spec)
    raise EvalInputError(f"--bench {spec}: no such file, and not one of the named benchmarks {sorted(BENCHMARKS)}")
