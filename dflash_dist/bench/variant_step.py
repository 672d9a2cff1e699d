"""Each DFlash-family variant's drafter step against DFlash's on the same batch: seconds and their ratio
(issue 35's target: at most 1.15x DFlash's step), at the real recipe's shape.

    OMP_NUM_THREADS=1 python -m dflash_dist.bench.variant_step [--variants dflash2,dspark,domino,dflash+full] [--reps 7]

The shape and batch are bench.dflash2_step's (SmolLM2-135M: hidden 576, vocabulary 49,152, one draft
layer, block 16; 10 samples of a 72-token prompt and a 128-token reply, 16 anchors each, float32 on CPU,
one thread as the recipe's drafter rank gets). Every drafter has the same backbone weights and its
variant's defaults (DSpark: Markov rank 256 and the confidence head; Domino: GRU 1024, E 256, lambda 0.5:
mid-run, both of its terms computed); a variant that reads the target's final hidden state gets one more
feature block (`parallel.transport.sends_final_hidden`, as a run sends it). The steps
(`training.step.drafter_step`, forward + backward, grads cleared) run interleaved, medians over `--reps`:
the ratio within one run is what compares on a shared machine.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from dflash_dist.bench.common import time_interleaved
from dflash_dist.bench.dflash2_step import add_shape_args, check_shape, make_batch, tied_head
from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import Config, ObjectiveConfig
from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.models.variants import RunProgress
from dflash_dist.parallel.transport import sends_final_hidden
from dflash_dist.training.step import StepBatch, drafter_step, step_settings

CPU = torch.device("cpu")
# name -> (model.draft.variant, objective.labels)
CASES = {"dflash": ("dflash", "data"), "dflash2": ("dflash2", "data"), "dspark": ("dspark", "data"),
         "domino": ("domino", "data"), "dflash+full": ("dflash", "target_full")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.variant_step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="dflash2,dspark,domino,dflash+full", help=f"of {', '.join(CASES)}")
    add_shape_args(ap)
    ap.add_argument("--json", default="runs/bench/variant_step.json")
    args = ap.parse_args(argv)
    names = ["dflash"] + [v for v in args.variants.split(",") if v and v != "dflash"]
    bad = [v for v in names if v not in CASES]
    if bad:
        ap.error(f"--variants: {bad} not of {list(CASES)}")
    check_outputs(ap, args)
    spec = check_shape(ap, args, [CASES[n][0] for n in names])
    H, B, V = spec.hidden_size, spec.block_size, spec.vocab_size
    data, feats, anchors, anchor_cu = make_batch(args.seqs, args.prompt, args.reply, args.num_anchors,
                                                 (len(spec.target_layer_ids) + 1) * H, V, args.seed)
    embed, head = tied_head(spec, torch.Generator().manual_seed(args.seed))
    steps, backbone = {}, None
    for name in names:
        variant, labels = CASES[name]
        torch.manual_seed(args.seed)
        model = DFlashDrafter(replace(spec, variant=variant))
        model.attach_target_head(embed, head)
        if backbone is None:
            backbone = model.state_dict()
        model.load_state_dict(backbone, strict=False)  # the same backbone; a variant's own modules stay
        objective = ObjectiveConfig(block_size=B, num_anchors=args.num_anchors, labels=labels)
        settings = replace(step_settings(Config(objective=objective), model.spec), batch_mean=True)
        width = (len(spec.target_layer_ids) + sends_final_hidden(labels, model.variant.needs.final_hidden)) * H
        batch = StepBatch(data, feats[:, :width], None, anchors, anchor_cu, RunProgress(50, 100))

        def step(model=model, batch=batch, settings=settings):
            drafter_step(model, batch, settings)
            model.zero_grad(set_to_none=True)
        steps[name] = step

    secs = time_interleaved(steps, args.reps, args.warmup, CPU)
    A = anchors.numel()
    print(f"\n{data.num_tokens} tokens, {A} anchors, H {H}, V {V:,}, block {B}, float32 on CPU "
          f"({torch.get_num_threads()} threads), medians of {args.reps}, interleaved\n")
    print("| step | seconds | / dflash |\n|---|---:|---:|")
    for name in names:
        print(f"| {name} | {secs[name]:.3f} | {secs[name] / secs['dflash']:.2f} |")
    write_json(args.json, {"tokens": int(data.num_tokens), "anchors": A, "threads": torch.get_num_threads(),
                           "reps": args.reps, "seconds": secs,
                           "ratio": {n: secs[n] / secs["dflash"] for n in names}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
