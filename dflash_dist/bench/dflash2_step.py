"""A DFlash 2 drafter step against a DFlash step on the same batch: seconds and their ratio (issue 28's
target: dflash2 / dflash <= 1.15), and where DFlash 2's extra time goes.

    OMP_NUM_THREADS=1 python -m dflash_dist.bench.dflash2_step [--seqs 10] [--prompt 72] [--reply 128] [--reps 7]

One thread is what the recipe's drafter rank gets (parallel/dist.py splits the 2 cores over its 3 ranks);
without the variable torch takes every core.

The real recipe's shape (configs/smollm2_135m.yaml): SmolLM2-135M's hidden 576 and vocabulary 49,152,
one draft layer (9 / 3 heads x 64, MLP 1536), block 16, 16 anchors per sequence; a batch of 10 samples of
a 72-token prompt and a 128-token reply (~160 anchors, the recipe's ~2,000 tokens), data labels,
float32 on CPU. Both drafters start from the same weights (dflash2's own modules randomised, so that the
walk is not the argmax path) and run `training.step.drafter_step` (forward + backward, grads cleared),
interleaved, medians over `--reps`. The breakdown times dflash2's parts alone on the step's final
hidden states: the LM head + loss (which also gives the selector its top-K), the selector term (loss and
path metrics), a head matmul and a topk over the drafted rows.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from dflash_dist.bench.common import time_interleaved, timed
from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import Config, ConfigError, ObjectiveConfig, ranged
from dflash_dist.data.collate import PackedBatch
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec, anchor_seq_starts
from dflash_dist.models.variants import variant_of
from dflash_dist.models.variants.dflash2.loss import selector_term
from dflash_dist.training.objective import anchor_generator, block_labels, draw_anchors, lm_head_loss
from dflash_dist.training.step import StepBatch, drafter_step, step_settings

CPU = torch.device("cpu")
GAMMA = 7.0

SPEC = DraftSpec(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                 num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5, block_size=16, mask_token_id=16,
                 target_layer_ids=(1, 14, 27), num_target_layers=30)


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The batch, shape and timing flags of the step benchmarks (this one and bench.variant_step), each
    with its range (a value outside it: argparse's exit 2 naming the flag). A sequence is at least a
    prompt token and a reply token, so that it has an anchor."""
    ap.add_argument("--seqs", type=ranged(int, ge=1), default=10)
    ap.add_argument("--prompt", type=ranged(int, ge=1), default=72)
    ap.add_argument("--reply", type=ranged(int, ge=1), default=128)
    ap.add_argument("--num-anchors", type=ranged(int, ge=1), default=16, help="per sequence")
    ap.add_argument("--vocab", type=ranged(int, ge=2), default=SPEC.vocab_size)
    ap.add_argument("--hidden", type=ranged(int, ge=1), default=SPEC.hidden_size)
    ap.add_argument("--reps", type=ranged(int, ge=1), default=7)
    ap.add_argument("--warmup", type=ranged(int, ge=0), default=1)
    ap.add_argument("--seed", type=ranged(int, ge=0), default=0)


def check_shape(ap: argparse.ArgumentParser, args: argparse.Namespace, variants) -> DraftSpec:
    """The spec of the flags' shape, once every variant timed accepts it by the checks training runs
    (`Variant.check`: DFlash 2's groups of 16 channels must divide --hidden, its top-16 candidates fit in
    --vocab); else argparse's exit 2 naming the flag, before any drafter is built or step timed. Each
    flag is tried alone on the reference shape, so the refusal names the one at fault."""
    for flag, field in (("--hidden", "hidden_size"), ("--vocab", "vocab_size")):
        shape = replace(SPEC, **{field: getattr(args, flag[2:])})  # the target's shape, as a spec has it
        for name in variants:
            try:
                variant = variant_of(name)
                variant.check(variant.Model(), shape)  # the variant's default options, as the bench times
            except ConfigError as exc:
                ap.error(f"{flag} {getattr(args, flag[2:])}: {name} refuses this shape ({exc})")
    return replace(SPEC, vocab_size=args.vocab, hidden_size=args.hidden, mask_token_id=min(16, args.vocab - 1))


def make_batch(seqs: int, prompt: int, reply: int, anchors: int, feat: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = seqs * (prompt + reply)
    mask = torch.zeros(n, dtype=torch.bool)
    for s in range(seqs):
        mask[s * (prompt + reply) + prompt:(s + 1) * (prompt + reply)] = True
    cu = torch.arange(seqs + 1) * (prompt + reply)
    data = PackedBatch(torch.randint(0, vocab, (n,), generator=gen), mask, cu)
    a, a_cu = draw_anchors(mask, cu, anchors, anchor_generator(seed, 0, 0))
    return data, torch.randn(n, feat, generator=gen), a, a_cu


def tied_head(spec: DraftSpec, gen: torch.Generator) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """A random frozen embedding and LM head, tied as SmolLM2's."""
    embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.normal_(0, 0.05, generator=gen)
        head.weight.copy_(embed.weight)
    return embed, head


def make_drafters(spec: DraftSpec, seed: int) -> dict[str, DFlashDrafter]:
    gen = torch.Generator().manual_seed(seed)
    embed, head = tied_head(spec, gen)
    out = {}
    for variant in ("dflash", "dflash2"):
        torch.manual_seed(seed)
        m = DFlashDrafter(replace(spec, variant=variant))
        m.attach_target_head(embed, head)
        out[variant] = m
    d1, d2 = out["dflash"], out["dflash2"]
    d2.load_state_dict(d1.state_dict(), strict=False)  # the same backbone
    with torch.no_grad():
        for name, p in d2.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0, 0.02, generator=gen)
                if name.endswith("base_kernel"):
                    p[:, 0] += 1.0
    return out


def breakdown(model: DFlashDrafter, data, feats, anchors, anchor_cu, reps: int, warmup: int) -> dict[str, float]:
    """Seconds of dflash2's parts on one set of final hidden states (the step's, detached)."""
    s, head = model.spec, model.lm_head.weight
    labels, weights = block_labels(data.input_ids, data.loss_mask, data.cu_seqlens, anchors, anchor_cu,
                                   s.block_size, GAMMA)
    with torch.no_grad():
        hidden = model.draft_hidden(model.context(feats), data.input_ids, data.position_ids, anchors,
                                    anchor_seq_starts(data.cu_seqlens, anchor_cu, anchors.numel()))

    def run(fn):
        return timed(fn, reps, warmup, CPU)

    def head_loss():
        h = hidden.clone().requires_grad_()
        lm_head_loss(h, head, labels, weights, top_k=s.options.selector_top_k)[0].backward()

    top = lm_head_loss(hidden, head, labels, weights, top_k=s.options.selector_top_k)[2]

    def selector():
        h = hidden.clone().requires_grad_()
        selector_term(model, h, data.input_ids, anchors, labels, weights, top)[0].backward()

    flat = hidden[:, 1:].reshape(-1, s.hidden_size)
    return {"LM head + loss + top-K (fwd+bwd)": run(head_loss), "selector term (fwd+bwd)": run(selector),
            "  a head matmul over the drafted rows": run(lambda: flat @ head.T),
            "  topk over the vocabulary": run(lambda z=flat @ head.T: z.topk(s.options.selector_top_k, dim=-1))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.dflash2_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--json", default="runs/bench/dflash2_step.json")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    spec = check_shape(ap, args, ("dflash", "dflash2"))
    drafters = make_drafters(spec, args.seed)
    feat = len(spec.target_layer_ids) * spec.hidden_size
    data, feats, anchors, anchor_cu = make_batch(args.seqs, args.prompt, args.reply, args.num_anchors, feat,
                                                 spec.vocab_size, args.seed)

    def step(model):
        settings = step_settings(Config(objective=ObjectiveConfig(block_size=spec.block_size, gamma=GAMMA, loss_norm="batch")),
                                 model.spec)

        def go():
            model.zero_grad(set_to_none=True)
            drafter_step(model, StepBatch(data, feats, None, anchors, anchor_cu), settings)
        return go

    sec = time_interleaved({k: step(m) for k, m in drafters.items()}, args.reps, args.warmup, CPU)
    res = {"shape": {"seqs": args.seqs, "tokens": data.num_tokens, "anchors": int(anchors.numel()),
                     "hidden": spec.hidden_size, "vocab": spec.vocab_size, "block": spec.block_size,
                     "top_k": drafters["dflash2"].spec.options.selector_top_k, "threads": torch.get_num_threads()},
           "step_s": sec, "ratio": sec["dflash2"] / sec["dflash"]}
    if not args.no_breakdown:
        res["dflash2_parts_s"] = breakdown(drafters["dflash2"], data, feats, anchors, anchor_cu, args.reps,
                                           args.warmup)
    write_json(args.json, res)
    sh = res["shape"]
    print(f"{sh['tokens']} tokens, {sh['anchors']} anchors, H {sh['hidden']}, V {sh['vocab']:,}, block {sh['block']}, "
          f"top-{sh['top_k']}, float32 on CPU ({sh['threads']} threads), medians of {args.reps}\n")
    print("| step | seconds | / dflash |\n|---|---:|---:|")
    for k, v in sec.items():
        print(f"| {k} | {v:.3f} | {v / sec['dflash']:.2f} |")
    for k, v in res.get("dflash2_parts_s", {}).items():
        print(f"| {k} | {v:.3f} | {v / sec['dflash']:.2f} |")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
