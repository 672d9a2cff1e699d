"""The evaluation's decoders side by side: today's full recompute vs the KV-cached hf engine.

python -m dflash_dist.bench.evaluate [--prompt-len 512] [--new-tokens 256] [--reps 2] [--json runs/bench/evaluate.json]

For each target (the built-in tiny Qwen3 of the default config, and a transformers Qwen3 of the same
shape, in float32 on one CPU thread, as `dflash_dist.evaluate` runs on CPU): one random prompt, a
random drafter of the default spec (its acceptance is the same for both decoders, which are checked
equal token for token and step for step), and the wall time of
  reference  `evaluation.reference.speculative_generate`: the target recomputes the whole sequence at
             every verify step (the decoder `evaluate` had before);
  cached     `evaluation.speculative.speculative`: verify on the target's KV cache, cut back after it;
  greedy     `evaluation.speculative.target_greedy`: the target alone on its cache (the speedup's base).
Medians over --reps runs, the order rotating. Both wall time and this process's CPU time are taken:
on a shared machine the wall time of many small ops stretches with the other jobs' load, while the CPU
time (one thread) is the work each decoder does; the table gives both ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import load_config, ranged
from dflash_dist.evaluation.reference import speculative_generate
from dflash_dist.evaluation.speculative import speculative, target_greedy
from dflash_dist.models.build import build_drafter, build_target, draft_spec

CPU = torch.device("cpu")


def hf_twin(cfg):
    """A transformers Qwen3 with the tiny target's shape (random weights), wrapped as the run wraps one."""
    import transformers

    from dflash_dist.models.hf_target import HFTarget
    t = cfg.model.target
    hc = transformers.Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                                  num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
                                  num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, max_position_embeddings=4096,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    return HFTarget(transformers.AutoModelForCausalLM.from_config(hc).float().eval())


def measure(name: str, target, cfg, prompt_len: int, new: int, reps: int) -> dict:
    drafter = build_drafter(draft_spec(cfg, target), target, seed=0, device=CPU).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size - 1, (prompt_len,), generator=gen).tolist()
    runs = {"reference": lambda: speculative_generate(target, drafter, prompt, new),
            "cached": lambda: speculative(target, drafter, prompt, new),
            "greedy": lambda: target_greedy(target, prompt, new)}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    outs = {}
    names = list(runs)
    for i in range(reps):
        for k in names[i % 3:] + names[:i % 3]:
            t0, c0 = time.perf_counter(), time.process_time()
            outs[k] = runs[k]()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    ref_tokens, ref_steps = outs["reference"]
    same = ref_tokens == outs["cached"].tokens == outs["greedy"].tokens and ref_steps == outs["cached"].accepted
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {"target": name, "prompt_len": prompt_len, "new_tokens": new, "steps": len(ref_steps),
            "tau": sum(ref_steps) / len(ref_steps), "equal": same, "seconds": med, "cpu_seconds": med_cpu,
            "cached_speedup_over_reference": med["reference"] / med["cached"],
            "cached_speedup_over_reference_cpu": med_cpu["reference"] / med_cpu["cached"],
            "speculative_speedup_over_greedy": med["greedy"] / med["cached"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=ranged(int, ge=1), default=512)
    ap.add_argument("--new-tokens", type=ranged(int, ge=1), default=256)
    ap.add_argument("--reps", type=ranged(int, ge=1), default=2)
    ap.add_argument("--json", default="runs/bench/evaluate.json")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (the tiny target's shape)")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    torch.set_num_threads(1)  # as `dflash_dist.evaluate` runs on CPU
    cfg = load_config(overrides=["model.target.dtype=float32", *args.overrides])
    rows = [measure("tiny (built-in)", build_target(cfg, CPU), cfg, args.prompt_len, args.new_tokens, args.reps),
            measure("transformers Qwen3", hf_twin(cfg), cfg, args.prompt_len, args.new_tokens, args.reps)]
    print(f"{'target':<20} {'prompt':>6} {'new':>4} {'steps':>5}  {'wall s: reference':>17} {'cached':>6} {'greedy':>6}"
          f"  {'CPU s: reference':>16} {'cached':>6}  {'cached vs reference: wall':>25} {'CPU':>5}  equal")
    for r in rows:
        s, c = r["seconds"], r["cpu_seconds"]
        print(f"{r['target']:<20} {r['prompt_len']:>6} {r['new_tokens']:>4} {r['steps']:>5}  {s['reference']:>17.2f} "
              f"{s['cached']:>6.2f} {s['greedy']:>6.2f}  {c['reference']:>16.2f} {c['cached']:>6.2f}  "
              f"{r['cached_speedup_over_reference']:>24.1f}x {r['cached_speedup_over_reference_cpu']:>4.1f}x  "
              f"{'yes' if r['equal'] else 'NO'}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    write_json(args.json, {"machine": machine_name(), "threads": 1, "load_avg_1min": load,
                           "rows": rows})


def machine_name() -> str:
    """The machine's architecture (x86_64, aarch64), from the uname system call: platform.processor()
    runs `uname -p` as a process on Linux, which the unit tier forbids and the record does not need."""
    return os.uname().machine


if __name__ == "__main__":
    main()
