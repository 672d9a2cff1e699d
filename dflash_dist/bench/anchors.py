"""What reaches the objective: samples skipped for want of an anchor, and (token, slot) pairs trained per
sample, under the old anchor rule (the whole block inside the sequence: p <= len - B) and the current one
(any p whose next token is supervised, blocks running past the end are masked there).

    python -m dflash_dist.bench.anchors [--samples 902000] [--block-size 16] [--num-anchors 512]

Two length mixes, supervised tokens at each sample's tail (a chat sample's response):
  chat mix     the 902K reference chat mix of bench.plan (data.synthetic.chat_lengths)
  short        responses of 1-22 tokens after prompts of 7-8 tokens (8-30 tokens in all): one-line
               replies, tool calls, the end of every multi-turn exchange
Counted in closed form per sample (no draw): anchors = min(num_anchors, candidates), and each candidate p
trains the slots k >= 1 with p + k inside the sequence, so the expected pairs are anchors / candidates x
the candidates' summed valid slots. The last supervised token of a sample is labelled at slot B - 1 only
under the old rule (its only candidate is B - 1 tokens before it), at every slot 1..B-1 now.
"""
from __future__ import annotations

import argparse

import numpy as np

from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import ranged
from dflash_dist.data.synthetic import chat_lengths


def _valid_slots(c: np.ndarray, B: int) -> np.ndarray:
    """sum_{q=1..c} min(B - 1, q): the valid slots of candidates whose distance to the last token is
    q = 1..c (a candidate q tokens before the end labels min(B - 1, q) slots)."""
    c = c.astype(np.float64)
    small = c * (c + 1) / 2
    big = (B - 1) * B / 2 + (c - (B - 1)) * (B - 1)
    return np.where(c <= B - 1, small, big)


def reach(lengths: np.ndarray, supervised: np.ndarray, B: int, num_anchors: int) -> dict:
    """Both rules on tail-supervised samples: skipped share, mean anchors and pairs per sample."""
    lengths, sup = lengths.astype(np.int64), supervised.astype(np.int64)
    first = np.maximum(lengths - sup - 1, 0)  # first candidate position (p + 1 is the first supervised token)
    rules = {
        # old: p in [first, len - B]; each candidate labels all B - 1 slots
        "block_inside": (np.maximum(lengths - B - first + 1, 0), lambda c: c * (B - 1.0)),
        # now: p in [first, len - 2]; the candidate q tokens before the end labels min(B - 1, q) slots
        "to_the_end": (np.clip(np.minimum(sup, lengths - 1), 0, None), lambda c: _valid_slots(c, B)),
    }
    out = {}
    for name, (cand, slots) in rules.items():
        anchors = np.minimum(cand, num_anchors)
        pairs = np.where(cand > 0, anchors / np.maximum(cand, 1) * slots(cand), 0.0)
        out[name] = {"skipped_share": float((cand <= 0).mean()), "skipped": int((cand <= 0).sum()),
                     "anchors_per_sample": float(anchors.mean()), "pairs_per_sample": float(pairs.mean())}
    return out


def short_mix(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 31, samples)
    prompt = np.minimum(rng.integers(7, 9, samples), lengths - 1)
    return lengths, lengths - prompt


def report(res: dict) -> str:
    lines = [f"block size {res['block_size']}, {res['num_anchors']} anchors per sequence at most", "",
             "| mix | rule | skipped (no anchor) | anchors / sample | (token, slot) pairs / sample |",
             "|---|---|---:|---:|---:|"]
    for mix, rules in res["mixes"].items():
        for rule, r in rules.items():
            lines.append(f"| {mix} | {rule} | {r['skipped_share']:.2%} ({r['skipped']:,}) | {r['anchors_per_sample']:.1f} "
                         f"| {r['pairs_per_sample']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.anchors", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=ranged(int, ge=1), default=902_000)
    ap.add_argument("--short-samples", type=ranged(int, ge=1), default=400)
    ap.add_argument("--block-size", type=ranged(int, ge=2), default=16)
    ap.add_argument("--num-anchors", type=ranged(int, ge=1), default=512)
    ap.add_argument("--token-budget", type=ranged(int, ge=1), default=49_152)
    ap.add_argument("--seed", type=ranged(int, ge=0), default=0)
    ap.add_argument("--json", default="runs/bench/anchors.json")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    B, A = args.block_size, args.num_anchors
    mixes = {f"chat mix ({args.samples:,})": chat_lengths(args.samples, args.token_budget, args.seed),
             f"short 8-30 tokens ({args.short_samples:,})": short_mix(args.short_samples, args.seed)}
    res = {"block_size": B, "num_anchors": A, "mixes": {k: reach(*v, B, A) for k, v in mixes.items()}}
    write_json(args.json, res)
    print(report(res))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
