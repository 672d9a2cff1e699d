"""What data.prepare draws from its inputs: a mixture of sources with weights, a held-out split of whole
conversations, and exact duplicates.

  * `--input FILE[:WEIGHT]`, repeatable: a weight is the expected number of times each line of that source
    is drawn: floor(w) copies, and one more with probability frac(w) from a generator seeded by (--seed,
    the source's place), so a draw does not depend on the workers or on the other sources.
  * `--heldout N`: N whole conversations, chosen by --seed among the lines that read as conversations with
    user turns and no tool results (what a prompt file can replay), are left out of the samples and written
    as OUTPUT/heldout.jsonl, one {"turns": [user messages...]} per line: the prompt format `evaluate --bench`
    and `train.eval_bench` take.
  * Exact duplicates (the same normalised messages and tools) are counted per source, and dropped after
    their first occurrence under --dedup.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HELDOUT = "heldout.jsonl"


class SourceError(ValueError):
    """An --input flag the run cannot use (exit 2)."""


@dataclass(frozen=True)
class Source:
    path: str
    weight: float = 1.0


@dataclass(frozen=True)
class Selection:
    """The driver's choices over all sources (meta.json records them)."""
    heldout: int = 0
    dedup: bool = False
    seed: int = 0


@dataclass
class SourceCounts:
    """One source's record in meta.json's "sources"."""
    path: str
    weight: float
    lines: int = 0
    draws: int = 0  # samples written counting repeats (a line of weight 2 drawn twice counts its samples twice)
    kept_lines: int = 0
    samples: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    heldout: int = 0
    not_drawn: int = 0  # lines a fractional weight drew 0 times (not read further)
    duplicates: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


def parse_source(spec: str) -> Source:
    """`FILE` or `FILE:WEIGHT` (a path that exists as given is a path, colon or not)."""
    head, sep, tail = spec.rpartition(":")
    if Path(spec).exists() or not sep or not head:
        return Source(spec)
    try:
        weight = float(tail)
    except ValueError:
        return Source(spec)  # a path with a colon that does not exist: named as not found
    if not math.isfinite(weight) or weight < 0:
        raise SourceError(f"--input {spec}: the weight must be a finite number >= 0, got {tail!r}")
    return Source(head, weight)


def check_sources(sources: list[Source]) -> None:
    """Every input exists and appears once: a repeated flag never silently replaces or doubles another."""
    seen: dict[str, str] = {}
    for s in sources:
        if not Path(s.path).exists():
            raise SourceError(f"--input {s.path}: no such file or directory")
        real = str(Path(s.path).resolve())
        if real in seen:
            raise SourceError(f"--input {s.path} is given twice (as {seen[real]} too): give it once, with a "
                              f"weight (FILE:2) to draw its lines more often")
        seen[real] = s.path


class Draws:
    """How many times each line of one source is written (module docstring)."""

    def __init__(self, weight: float, seed: int, index: int):
        self.whole, self.frac = int(math.floor(weight)), weight - math.floor(weight)
        self.rng = np.random.default_rng([seed, index])

    def next(self) -> int:
        # One draw per line whatever its weight, so line i's copies depend on the seed and i alone.
        u = self.rng.random()
        return self.whole + (1 if u < self.frac else 0)


def conversation_key(messages: list[dict], tools: Any) -> bytes:
    """A digest of the normalised conversation: exact duplicates share it."""
    text = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def heldout_turns(messages: list[dict]) -> list[str] | None:
    """The user turns a prompt file replays, or None where the conversation cannot be replayed as one (tool
    results, an empty user turn)."""
    if any(m["role"] == "tool" for m in messages):
        return None
    turns = [m["content"] for m in messages if m["role"] == "user"]
    return turns if turns and all(t.strip() for t in turns) else None


def choose_heldout(candidates: list[tuple[int, int]], n: int, seed: int) -> set[tuple[int, int]]:
    """n of the candidate (source index, line) keys, seeded; all of them when there are fewer (the caller
    refuses a split that leaves nothing to train on)."""
    if n >= len(candidates):
        return set(candidates)
    rng = np.random.default_rng([seed, 0x4E1D])
    return {candidates[i] for i in sorted(rng.choice(len(candidates), size=n, replace=False).tolist())}


def heldout_line(turns: list[str], where: str) -> str:
    return json.dumps({"turns": turns, "source": where}, ensure_ascii=False)
