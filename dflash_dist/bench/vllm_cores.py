"""vLLM on CPU with one core or with all of them: the same prompts, both engines of the project, in one run.

    python -m dflash_dist.bench.vllm_cores [--target DIR] [--prompts 8] [--prompt-len 64] [--new-tokens 128]
        [--reps 2] [--json runs/bench/vllm_cores.json]

vLLM's CPU executor keeps cores for its scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU; on a 2-core
machine the model worker gets one core); 0 gives the worker every core (data/regen/vllm_cpu.py keeps
vLLM's default, after this benchmark: docs/benchmarks.md). Each setting
runs in a fresh process (vLLM reads the variable when its engine starts), the settings alternating
(A B B A ... over --reps), each process timing
  regen  regeneration's engine (data/regen/vllm.py) decoding the prompts greedily, target only;
  eval   the evaluation's engine (evaluation/vllm_engine.py) decoding them with n-gram prompt lookup
         (the decoder that needs no drafter; B - 1 = 15 proposed tokens);
the same fixed token-id prompts, a fixed length (no stop token), after one short warm-up decode.
The target: --target DIR, or a Llama of SmolLM2-135M-Instruct's shape (30 layers, hidden 576, vocabulary
49,152) with seeded random weights, which costs the same per token as the real one.
Reported: each setting's tokens/s (median over reps) and the core list vLLM's start-up log gives.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dflash_dist.bench.jobs import check_outputs, write_json
from dflash_dist.config import ranged

SETTINGS = {"one core (vLLM's default)": "1", "all cores": "0"}  # VLLM_CPU_NUM_OF_RESERVED_CPU
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def make_target(path: Path) -> Path:
    """SmolLM2-135M's shape, random weights (seed 0), float32, with the bench's character tokenizer."""
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    from dflash_dist.bench.regenerate import make_tokenizer
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMOLLM2_SHAPE)).float().eval()
    model.save_pretrained(path)
    return path


def prompts(n: int, length: int) -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(6, 40) for _ in range(length)] for _ in range(n)]


def child(args) -> dict:
    """One setting's measurements, in this process (the variable is already in its environment)."""
    from dflash_dist.data.regen.engine import EngineSpec, Sampling
    from dflash_dist.data.regen.vllm import VllmEngine
    from dflash_dist.evaluation import vllm_engine as ev
    ps, new, out = prompts(args.prompts, args.prompt_len), args.new_tokens, {}
    max_len = args.prompt_len + new + 32
    regen = VllmEngine(EngineSpec(name="vllm", target=args.target, tokenizer=args.target, kv_cache_gib=0.5,
                                  max_model_len=max_len), stop_ids=[])
    regen.generate(ps[:1], [4], Sampling(4), [0])
    t0 = time.perf_counter()
    got = regen.generate(ps, [new] * len(ps), Sampling(new), list(range(len(ps))))
    out["regen"] = {"tokens": sum(len(g.ids) for g in got), "seconds": time.perf_counter() - t0}
    ev._shutdown(regen.llm)
    del regen
    llm = ev._llm(ev.VllmOptions(target=args.target, draft="", block_size=16, context=max_len, kv_cache_gib=0.5,
                                 max_model_len=max_len), "ngram")
    ev.generate(llm, ps[:1], [4], frozenset())
    answers, steps, seconds = ev.generate(llm, ps, [new] * len(ps), frozenset())
    out["eval"] = {"tokens": sum(len(a) for a in answers), "seconds": seconds, "verify_steps": steps}
    ev._shutdown(llm)
    return out


def run_setting(args, reserved: str) -> dict:
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU=reserved)
    cmd = [sys.executable, "-m", "dflash_dist.bench.vllm_cores", "--child", "--target", args.target,
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}: exit {res.returncode}\n{res.stderr[-3000:]}")
    result = json.loads(res.stdout.strip().splitlines()[-1])
    result["core_ids"] = sorted(set(re.findall(r"local_rank=0, core ids=(\[[^\]]*\])", res.stdout + res.stderr)))
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="model directory (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--prompts", type=ranged(int, ge=1), default=8)
    ap.add_argument("--prompt-len", type=ranged(int, ge=1), default=64)
    ap.add_argument("--new-tokens", type=ranged(int, ge=1), default=128)
    ap.add_argument("--reps", type=ranged(int, ge=1), default=2)
    ap.add_argument("--json", default="runs/bench/vllm_cores.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    check_outputs(ap, args)
    args.target = str(make_target(Path(args.target or "runs/bench/smollm2_shape")))
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            runs[name].append(run_setting(args, SETTINGS[name]))
    rows = []
    for name in names:
        rate = {job: statistics.median(r[job]["tokens"] / r[job]["seconds"] for r in runs[name]) for job in ("regen", "eval")}
        rows.append({"setting": name, "VLLM_CPU_NUM_OF_RESERVED_CPU": SETTINGS[name], "tokens_per_s": rate,
                     "core_ids": sorted({c for r in runs[name] for c in r["core_ids"]}), "runs": runs[name]})
    base = rows[0]["tokens_per_s"]
    print(f"{'setting':<26} {'core ids':<10} {'regen tok/s':>11} {'eval (ngram) tok/s':>18} {'ratio':>11}")
    for r in rows:
        t = r["tokens_per_s"]
        print(f"{r['setting']:<26} {','.join(r['core_ids']):<10} {t['regen']:>11.1f} {t['eval']:>18.1f} "
              f"{t['regen'] / base['regen']:>5.2f}/{t['eval'] / base['eval']:.2f}")
    write_json(args.json, {"cores": len(os.sched_getaffinity(0)), "load_avg_1min": os.getloadavg()[0],
                           "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "reps": args.reps, "rows": rows})


if __name__ == "__main__":
    main()
