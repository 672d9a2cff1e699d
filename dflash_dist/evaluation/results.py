"""What an evaluation reports, per prompt set and overall: the figures of the published tables.

Counts are kept as integers (so one rank and several give the same numbers, whatever the order):
  tau                    mean tokens committed per verify step (accepted drafts + the bonus), the
                         acceptance length z-lab and the engines report (vLLM: 1 + accepted / drafts);
  accepted_per_position  B-1 counts: steps whose k-th drafted token was accepted (vLLM's
                         spec_decode_num_accepted_tokens_per_pos); acceptance is a prefix, so these give
  histogram              the share of verify steps committing 1, 2, ..., B tokens;
  tokens_per_s / speedup new tokens over the wall time of target-only greedy decoding and of speculative
                         decoding (same engine, device, prompts and lengths); speedup = their ratio;
  output_digest          a fingerprint of every answer's token ids, in prompt and turn order (equal digests:
                         equal outputs, whichever engine or decoder produced them).
With `--baselines` (vllm engine) the document's "baselines" holds the same figures, per set and overall, of
the target decoding alone ("target": tau 1) and of vLLM's n-gram prompt lookup ("ngram") on the same
prompts, every verify step counted (steps where the proposer found nothing included).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_dist.io.files import write_json


@dataclass
class Tally:
    block_size: int  # the most tokens a verify step commits (the block size; DSpark's: B + 1, `DraftSpec.step_tokens`)
    num_prompts: int = 0  # conversations (or token-id prompts)
    num_turns: int = 0  # decoded answers: one per turn of each conversation
    num_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    new_tokens: int = 0
    target_s: float = 0.0
    speculative_s: float = 0.0
    mismatches: int = 0  # answers whose speculative output differs from target-only greedy
    answer_digests: list[str] = field(default_factory=list)  # answer_digest of each answer, in order
    proposal_steps: int | None = None  # vllm: verify steps with a proposal (vLLM's spec_decode_num_drafts)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * (self.block_size - 1)

    def add_steps(self, accepted: list[int]) -> None:
        """One decode's steps, each the number of tokens it committed (1..B)."""
        self.num_steps += len(accepted)
        for a in accepted:
            for k in range(a - 1):
                self.accepted_per_position[k] += 1

    def merge(self, other: "Tally") -> None:
        for name in ("num_prompts", "num_turns", "num_steps", "new_tokens", "target_s", "speculative_s", "mismatches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        mine, theirs = self.accepted_per_position, other.accepted_per_position
        if len(theirs) > len(mine):  # an overall tally of the block size, DSpark's tallies one position longer
            mine = mine + [0] * (len(theirs) - len(mine))
        self.accepted_per_position = [a + b for a, b in zip(mine, theirs + [0] * (len(mine) - len(theirs)))]
        self.answer_digests = self.answer_digests + other.answer_digests
        if other.proposal_steps is not None:
            self.proposal_steps = (self.proposal_steps or 0) + other.proposal_steps

    def histogram(self) -> list[float]:
        """Share of steps committing 1..B tokens, from the per-position counts (acceptance is a prefix)."""
        at_least = [self.num_steps] + self.accepted_per_position + [0]  # steps committing >= j + 1 tokens
        return [(at_least[j] - at_least[j + 1]) / self.num_steps if self.num_steps else 0.0
                for j in range(len(self.accepted_per_position) + 1)]

    def to_json(self) -> dict:
        steps = self.num_steps
        tau = 1.0 + sum(self.accepted_per_position) / steps if steps else 0.0
        rate = lambda s: self.new_tokens / s if s > 0 else None  # noqa: E731
        r = {"tau": tau, "accepted_per_position": list(self.accepted_per_position), "histogram": self.histogram(),
             "num_prompts": self.num_prompts, "num_turns": self.num_turns, "num_steps": steps,
             "new_tokens": self.new_tokens, "exact": self.mismatches == 0, "mismatches": self.mismatches,
             "tokens_per_s": {"target": rate(self.target_s), "speculative": rate(self.speculative_s)},
             "speedup": self.target_s / self.speculative_s if self.speculative_s > 0 else None,
             "output_digest": hashlib.sha256(",".join(self.answer_digests).encode()).hexdigest()[:16]}
        if self.proposal_steps is not None:
            r["proposal_steps"] = self.proposal_steps
        return r


def answer_digest(tokens: list[int]) -> str:
    """A short fingerprint of one answer's token ids: rows compare outputs without carrying them."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def _rows(block_size: int, tallies: dict[str, Tally]) -> dict:
    overall = Tally(block_size)
    for t in tallies.values():
        overall.merge(t)
    return {"sets": {name: t.to_json() for name, t in tallies.items()}, "overall": overall.to_json()}


def report(engine: str, block_size: int, tallies: dict[str, Tally], baselines: dict[str, dict[str, Tally]] | None = None,
           **info) -> dict:
    """The result document: per set, and the sum over sets as "overall"; the baselines' beside them."""
    doc = {"engine": engine, "block_size": block_size, **info, **_rows(block_size, tallies)}
    if baselines:
        doc["baselines"] = {name: _rows(block_size, t) for name, t in baselines.items()}
    return doc


def table(result: dict) -> str:
    """The command's result on stdout (progress and diagnostics go to logging); one row per set and the
    overall row, whitespace-separated (accepted per position joined by "/"), `exact` last."""
    B = result["block_size"]
    rows = [f"{'prompt set':<24} {'prompts':>7} {'turns':>5} {'steps':>6} {'tau':>6} {'B':>3} {'speedup':>7}  "
            f"{'accepted per position':<24} exact"]
    for name, r in [*result["sets"].items(), ("overall", result["overall"])]:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        per_pos = "/".join(str(c) for c in r["accepted_per_position"])
        exact = "yes" if r["exact"] else f"NO({r['mismatches']})"
        rows.append(f"{name.replace(' ', '_'):<24} {r['num_prompts']:>7} {r['num_turns']:>5} {r['num_steps']:>6} "
                    f"{r['tau']:>6.3f} {B:>3} {speed:>7}  {per_pos:<24} {exact}")
    text = "\n".join(rows) + "\n"
    return text + baseline_table(result) if result.get("baselines") else text


def baseline_table(result: dict) -> str:
    """The drafter beside the baselines, per set and overall: tau per verify step and tokens/s (each
    decoder's new tokens over its own wall time), `exact` = same answers as target-only decoding."""
    decoders = [("dflash", result), *result["baselines"].items()]
    rows = ["", f"{'prompt set':<24} {'decoder':<8} {'steps':>6} {'new tokens':>10} {'tau':>6} {'tokens/s':>9}  exact"]
    for name in [*result["sets"], "overall"]:
        for decoder, doc in decoders:
            r = doc["overall"] if name == "overall" else doc["sets"][name]
            rate = "-" if r["tokens_per_s"]["speculative"] is None else f"{r['tokens_per_s']['speculative']:.1f}"
            exact = "yes" if r["exact"] else f"NO({r['mismatches']})"
            rows.append(f"{name.replace(' ', '_'):<24} {decoder:<8} {r['num_steps']:>6} {r['new_tokens']:>10} "
                        f"{r['tau']:>6.3f} {rate:>9}  {exact}")
    return "\n".join(rows) + "\n"


def save(result: dict, path: str | Path) -> None:
    write_json(Path(path), result)


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
