"""Acceptance length by real greedy draft-then-verify decoding against the target.

One decoding step: the last committed token is the anchor; the drafter sees the target's features of
every position before it and proposes the B-1 tokens after it in one forward; the target verifies the
block in one forward; the longest prefix that matches the target's own greedy choices is accepted, plus
the target's token at the first disagreement (the bonus, which is the next anchor). tau is the mean of
(accepted + 1) over steps. Greedy verification makes the output token-for-token the target's own greedy
output, which `acceptance_length` checks.

The target recomputes the whole sequence at every verify step (no KV cache): simple and exact at the
scale this runs at; the drafter's context comes from that same forward.

CLI: python -m dflash_dist.evaluate --draft DIR [--config FILE] [key=value ...] [--prompts FILE.jsonl ...]
     [--max-new-tokens N] [--num-prompts N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from dflash_dist.data.regenerate import split_samples
from dflash_dist.decode import recompute_greedy

log = logging.getLogger(__name__)


def _device(target) -> torch.device:
    return target.embed_tokens.weight.device


def _run_target(target, ids: Sequence[int], layer_ids: Sequence[int]):
    """(features (n, F), logits (n, V)) of one sequence."""
    dev = _device(target)
    t = torch.tensor(list(ids), dtype=torch.long, device=dev)
    cu = torch.tensor([0, len(t)], dtype=torch.long, device=dev)
    return target.capture(t, cu, torch.arange(len(t), device=dev), list(layer_ids), need_logits=True)


def greedy_generate(target, prompt_ids: Sequence[int], n: int) -> list[int]:
    """The target's own greedy continuation of one prompt, by full recompute (the reference)."""
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=_device(target))
    return recompute_greedy(target, prompt, n)[0].tolist()


@torch.no_grad()
def propose_block(drafter, features: torch.Tensor, seq: Sequence[int]) -> list[int]:
    """The drafter's B-1 tokens after the anchor seq[-1], given target features of seq[:-1]."""
    anchor = len(seq) - 1
    dev = features.device
    # The anchor's own feature row is never attended (context is strictly before it): zeros fill it.
    feats = torch.cat([features[:anchor], features.new_zeros(1, features.shape[1])])
    ids = torch.tensor(list(seq), dtype=torch.long, device=dev)
    logits = drafter(feats, ids, torch.tensor([0, anchor + 1], device=dev), torch.arange(anchor + 1, device=dev),
                     torch.tensor([anchor], device=dev), torch.tensor([0, 1], device=dev))
    return logits[0, 1:].argmax(-1).tolist()


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: Sequence[int],
                         max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(max_new_tokens new tokens, accepted length of every verify step). Each step commits between 1
    and B tokens; the output is cut at max_new_tokens, the step's acceptance is counted whole."""
    layer_ids = list(drafter.spec.target_layer_ids)
    B = drafter.spec.block_size
    seq = [int(t) for t in prompt_ids]
    if not seq:
        raise ValueError("speculative_generate needs a non-empty prompt")
    feats, logits = _run_target(target, seq, layer_ids)
    seq.append(int(logits[-1].argmax()))  # the first anchor: the target's own next token
    accepted: list[int] = []
    while len(seq) - len(prompt_ids) < max_new_tokens:
        anchor = len(seq) - 1
        draft = propose_block(drafter, feats, seq)
        feats, logits = _run_target(target, seq + draft, layer_ids)
        choice = logits[anchor:anchor + B].argmax(-1).tolist()  # target's token for anchor+1 .. anchor+B
        a = 0
        while a < B - 1 and draft[a] == choice[a]:
            a += 1
        # feats stay valid up to the new anchor: every position before it holds an accepted token.
        seq += draft[:a] + [choice[a]]
        accepted.append(a + 1)
    return seq[len(prompt_ids):][:max_new_tokens], accepted


class SpeculativeMismatch(RuntimeError):
    """Speculative decoding did not reproduce the target's greedy output."""


def acceptance_length(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      strict: bool = False) -> dict:
    """tau over all verify steps of all prompts, with the check that speculative output == greedy output.
    A mismatch is counted and logged (bf16 recompute can flip a near-tie); strict=True raises instead."""
    steps: list[int] = []
    per_prompt, mismatches = [], 0
    was_training = drafter.training
    drafter.eval()
    try:
        for i, p in enumerate(prompts):
            out, acc = speculative_generate(target, drafter, p, max_new_tokens)
            ref = greedy_generate(target, p, max_new_tokens)
            if out != ref:
                mismatches += 1
                first = next(k for k, (x, y) in enumerate(zip(out, ref)) if x != y)
                msg = f"prompt {i}: speculative output differs from greedy at new token {first}"
                if strict:
                    raise SpeculativeMismatch(msg)
                log.warning("%s", msg)
            steps += acc
            per_prompt.append(float(np.mean(acc)) if acc else 0.0)
    finally:
        drafter.train(was_training)
    return {"tau": float(np.mean(steps)) if steps else 0.0, "num_prompts": len(prompts), "num_steps": len(steps),
            "new_tokens": len(prompts) * max_new_tokens, "mismatches": mismatches, "exact": mismatches == 0,
            "tau_per_prompt": per_prompt, "block_size": drafter.spec.block_size}


def heldout_prompts(cfg, n: int) -> list[list[int]]:
    """Prompts the run never trained on, from the synthetic corpus's own distribution. The successor
    table depends on the seed alone, while a larger draw shifts the random stream, so the tail of a
    corpus of num_samples + n samples holds new sequences that follow the same rule. A prompt that
    happens to equal a training prompt (short and noise-free) is dropped."""
    from dflash_dist.data.synthetic import synthetic_dataset
    syn = cfg.data.synthetic
    vocab = cfg.model.target.vocab_size
    train_ds = synthetic_dataset(syn, vocab)
    seen = set(prompts_of(train_ds, range(len(train_ds))))
    ds = synthetic_dataset(dataclasses.replace(syn, num_samples=syn.num_samples + n), vocab)
    return [list(p) for p in prompts_of(ds, range(len(ds) - n, len(ds))) if p and p not in seen]


def prompts_of(ds, indices) -> list[tuple[int, ...]]:
    """The prompts (unsupervised prefixes) of the given samples."""
    plen, _ = split_samples(ds)
    return [tuple(ds.sample(i)[0][:plen[i]].tolist()) for i in indices]


def read_prompts(path: str | Path) -> list[list[int]]:
    """JSONL: each line a list of token ids, or an object with "input_ids" (or "prompt_ids")."""
    prompts = []
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, dict):
            item = item.get("input_ids", item.get("prompt_ids"))
        if not isinstance(item, list) or not item or not all(isinstance(t, int) for t in item):
            raise ValueError(f"{path}:{k}: expected a non-empty list of token ids (or {{\"input_ids\": [...]}})")
        prompts.append(item)
    return prompts


def load_for_eval(draft_dir: str | Path, cfg, device: torch.device):
    """(target, drafter) ready to decode: the export must fit the target it is evaluated against."""
    from dflash_dist.export import load_drafter
    from dflash_dist.models.build import build_target
    target = build_target(cfg, device)
    drafter = load_drafter(Path(draft_dir)).to(device).eval()
    s = drafter.spec
    want = {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "num_target_layers": target.num_layers}
    bad = {k: (getattr(s, k), v) for k, v in want.items() if getattr(s, k) != v}
    if bad:
        raise ValueError(f"drafter {draft_dir} does not fit the target: " +
                         ", ".join(f"{k} {a} (drafter) != {b} (target)" for k, (a, b) in bad.items()))
    drafter.attach_target_head(target.embed_tokens, target.lm_head)
    return target, drafter


def main(argv=None) -> int:
    from dflash_dist.config import ConfigError, load_config
    ap = argparse.ArgumentParser(prog="dflash_dist.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="exported drafter directory (config.json, model.safetensors)")
    ap.add_argument("--config", help="YAML config of the run (it fixes the target)")
    ap.add_argument("--prompts", action="append", default=[], help="JSONL of token-id lists; repeatable")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32, help="held-out synthetic prompts when no --prompts")
    ap.add_argument("--strict", action="store_true", help="fail if speculative output differs from greedy")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(1)  # small ops one token at a time: extra threads only synchronise
        target, drafter = load_for_eval(args.draft, cfg, device)
        sets = {Path(p).name: read_prompts(p) for p in args.prompts}
        if not sets:
            if cfg.data.path:
                raise ConfigError("a prepared dataset has no held-out split here: pass --prompts FILE.jsonl")
            sets["synthetic-heldout"] = heldout_prompts(cfg, args.num_prompts)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    rows = [(name, acceptance_length(target, drafter, prompts, args.max_new_tokens, strict=args.strict))
            for name, prompts in sets.items()]
    # The command's result, a table on stdout; progress and diagnostics go to logging (stderr).
    lines = [f"{'prompt set':<24} {'prompts':>7} {'steps':>6} {'tau':>6} {'B':>3}  exact"]
    lines += [f"{name:<24} {r['num_prompts']:>7} {r['num_steps']:>6} {r['tau']:>6.3f} {r['block_size']:>3}  "
              f"{'yes' if r['exact'] else 'NO (%d)' % r['mismatches']}" for name, r in rows]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
