"""Regeneration engines side by side: vLLM and transformers on the same conversations, in one run.

    python -m dflash_dist.bench.regenerate [--conversations 200] [--max-new-tokens 64] [--json FILE]

Builds a tiny random Qwen3 target (the one the tests use: character tokenizer, Qwen3-style template;
its end-of-turn row is boosted so replies end at varied lengths), regenerates the same chat JSONL with
`--engine hf` and `--engine vllm` (float32, greedy, --on-length keep), checks the two outputs are
identical, and reports generated tokens/s of each (engine start-up timed apart; each engine's job run
--reps times, interleaved, median), then projects the seed's
scale (902K conversations, 1.35B new tokens) on 8 GPUs from a per-rank rate: the measured one, or
--rate-per-rank measured on the real target and GPU. A tiny model measures engine overhead (scheduling,
batching, Python per step), not arithmetic: the ratio says how much of the hf path is overhead.
"""
from __future__ import annotations

import argparse
import json
import os
import string
import time
from pathlib import Path

from dflash_dist.bench.jobs import check_outputs
from dflash_dist.config import ranged

SEED_CONVERSATIONS = 902_000
SEED_NEW_TOKENS = 1.35e9  # issue 20: the seed's run regenerated about 1.35 billion tokens

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]
CHARS = list(string.ascii_lowercase + string.digits + " \n.,?!'")
# Qwen3's template in short: past assistant turns lose their <think> block; the generation prompt opens an
# assistant turn, with an empty think block when thinking is off.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1].lstrip() }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
WORDS = ["the", "cat", "sat", "on", "a", "mat", "why", "is", "sky", "blue", "light", "ok.", "what", "4", "yes"]


def make_tokenizer(path: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tk.decoder = decoders.Fuse()  # decoded text is the characters themselves: ids <-> text round-trips
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_target(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Weights (float32) + tokenizer + generation_config in `path`. The end-of-turn token's output row is
    scaled up by 10%: a random model alone would (almost) never stop; this one ends replies after 5-30
    tokens on about half of the prompts (measured on these conversations) and runs on for the rest."""
    import torch
    import transformers
    tok = make_tokenizer(path)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=1,
                                   head_dim=32,  # vLLM's CPU attention wants head_dim >= 32
                                   max_position_embeddings=384, tie_word_embeddings=False,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 1.1
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    return path


def conversations(n: int, seed: int = 0, max_turns: int = 3) -> list[dict]:
    """OpenAI and ShareGPT lines, 1..max_turns user/assistant pairs, some with a system prompt."""
    import random
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": say(3)}] if i % 4 == 0 else []
        for _ in range(rng.randint(1, max_turns)):
            msgs += [{"role": "user", "content": say(rng.randint(2, 8))},
                     {"role": "assistant", "content": say(rng.randint(2, 10))}]
        if i % 3 == 1:
            sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
            out.append({"id": i, "conversations": [{"from": sharegpt[m["role"]], "value": m["content"]} for m in msgs]})
        else:
            out.append({"id": i, "messages": msgs})
    return out


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ----------------------------------------------------------------------------------- the benchmark

def build(name: str, target: Path, max_num_seqs: int = 0):
    """(spec, engine, start-up seconds) of one engine on the tiny target."""
    from dflash_dist.data.regen.chat import stop_token_ids
    from dflash_dist.data.regen.engine import EngineSpec
    from dflash_dist.data.regen.engines import build_engine
    from dflash_dist.data.regen.run import generation_config, load_tokenizer
    spec = EngineSpec(name=name, target=str(target), tokenizer=str(target), kv_cache_gib=0.5,
                      max_num_seqs=max_num_seqs)
    stops = stop_token_ids(load_tokenizer(str(target)), generation_config(str(target)))
    t0 = time.perf_counter()
    engine = build_engine(spec, stops)
    return spec, engine, time.perf_counter() - t0


def one_job(spec, engine, chats: Path, out: Path, max_new_tokens: int, chunk_size: int) -> tuple[float, dict]:
    """Seconds of the whole job (rendering, generation, chunk files, merge) and its meta."""
    from dflash_dist.data.regen.chunks import meta_path
    from dflash_dist.data.regen.engine import Sampling
    from dflash_dist.data.regen.run import Job, Shard, run
    out.unlink(missing_ok=True)
    job = Job(input=chats, output=out, engine=spec, sampling=Sampling(max_new_tokens), on_length="keep",
              chunk_size=chunk_size, progress_s=1e9)
    t0 = time.perf_counter()
    rc = run(job, Shard(), engine)
    job_s = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{spec.name}: regeneration exited {rc}")
    return job_s, json.loads(meta_path(out).read_text())


def measure(work: Path, target: Path, chats: Path, args) -> list[dict]:
    """Both engines built once, then their jobs interleaved `reps` times (the machine is shared and
    noisy: neither engine always runs first); the median job time of each."""
    import statistics
    built = {name: build(name, target, args.max_num_seqs) for name in ("hf", "vllm")}
    times: dict[str, list[float]] = {name: [] for name in built}
    metas = {}
    for rep in range(args.reps):
        for name in (("hf", "vllm") if rep % 2 == 0 else ("vllm", "hf")):
            spec, engine, _ = built[name]
            job_s, metas[name] = one_job(spec, engine, chats, work / f"{name}.jsonl", args.max_new_tokens,
                                         max(1, args.conversations))
            times[name].append(job_s)
    rows = []
    for name, (spec, engine, start_s) in built.items():
        job_s, meta = statistics.median(times[name]), metas[name]
        rows.append({"engine": name, "start_s": start_s, "job_s": job_s, "job_s_all": times[name],
                     "new_tokens": meta["new_tokens"], "replies": meta["replies"],
                     "conversations": meta["conversations_out"], "tok_per_s": meta["new_tokens"] / job_s})
    return rows


def projection(rate_per_rank: float, ranks: int = 8, start_s: float = 0.0) -> dict:
    """The seed's regeneration on `ranks` independent engines at `rate_per_rank` generated tokens/s."""
    hours = (SEED_NEW_TOKENS / (rate_per_rank * ranks) + start_s) / 3600
    return {"conversations": SEED_CONVERSATIONS, "new_tokens": SEED_NEW_TOKENS, "ranks": ranks,
            "rate_per_rank": rate_per_rank, "hours": hours,
            "new_tokens_per_conversation": SEED_NEW_TOKENS / SEED_CONVERSATIONS}


def report(res: dict) -> str:
    rows = [f"{'engine':8} {'start s':>8} {'job s (median)':>15} {'all job s':>20} {'new tokens':>11} {'replies':>8} "
            f"{'tok/s':>9}"]
    for r in res["engines"]:
        every = " ".join(f"{t:.2f}" for t in r["job_s_all"])
        rows.append(f"{r['engine']:8} {r['start_s']:8.1f} {r['job_s']:15.2f} {every:>20} {r['new_tokens']:11d} "
                    f"{r['replies']:8d} {r['tok_per_s']:9.1f}")
    rows.append(f"vllm / hf tokens/s: {res['speedup']:.2f}x; outputs identical: {res['identical']}")
    for label, p in res["projections"].items():
        rows.append(f"902K conversations ({p['new_tokens'] / 1e9:.2f}B new tokens, {p['new_tokens_per_conversation']:.0f}"
                    f"/conversation) on {p['ranks']} ranks at {p['rate_per_rank']:.0f} tok/s each ({label}): "
                    f"{p['hours']:.1f} h")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.regenerate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=ranged(int, ge=1), default=200)
    ap.add_argument("--max-new-tokens", type=ranged(int, ge=1), default=64)
    ap.add_argument("--hidden", type=ranged(int, ge=32), default=64,
                    help="tiny target's hidden size (a multiple of 32)")
    ap.add_argument("--layers", type=ranged(int, ge=1), default=2)
    ap.add_argument("--max-num-seqs", type=ranged(int, ge=0), default=0,
                    help="vLLM's sequences per step (0: its default)")
    ap.add_argument("--reps", type=ranged(int, ge=1), default=3,
                    help="jobs per engine, interleaved; the median is reported")
    ap.add_argument("--rate-per-rank", type=ranged(float, ge=0), default=0.0,
                    help="tokens/s of one engine on the real target and GPU, for a second projection")
    ap.add_argument("--dir", default="runs/bench/regenerate", help="scratch directory (target, chats, outputs)")
    ap.add_argument("--json", default="runs/bench/regenerate.json")
    args = ap.parse_args(argv)
    check_outputs(ap, args, dirs=("--dir",))
    import logging
    logging.basicConfig(level=logging.WARNING)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    target = make_target(work / "target", hidden=args.hidden, layers=args.layers)
    chats = write_jsonl(work / "chats.jsonl", conversations(args.conversations))
    engines = measure(work, target, chats, args)
    hf, vl = engines
    res = {"engines": engines, "speedup": vl["tok_per_s"] / hf["tok_per_s"],
           "identical": (work / "hf.jsonl").read_bytes() == (work / "vllm.jsonl").read_bytes(),
           "setup": {**vars(args), "cpus": os.cpu_count(), "dtype": "float32", "greedy": True}}
    res["projections"] = {"vllm, rate measured here": projection(vl["tok_per_s"], start_s=vl["start_s"])}
    if args.rate_per_rank:
        res["projections"]["--rate-per-rank"] = projection(args.rate_per_rank, start_s=vl["start_s"])
    print(report(res))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from rerunning the benchmark
    import sys
    sys.exit(main())
