"""python -m dflash_dist.data.regenerate --target DIR --input chats.jsonl --output out.jsonl [options]

Replaces every assistant turn of a chat JSONL (OpenAI `messages` or ShareGPT `conversations`) by the
target's own reply, turn by turn, and writes a chat JSONL of the same schema: one line per kept input
line, in input order, plus OUTPUT's meta file (out.meta.json: counts, skips by reason, the settings).
Under torchrun (or srun + torchrun) each rank runs its own engine on its share of the chunks; rank 0
merges. Rerunning the same command resumes; SIGTERM/SIGUSR2 stop after the current chunk (exit 75).
Exit 2: bad input, a full disk (named), another run on the same --output, or nothing usable produced;
exit 3: a peer rank died (named).
(The default job's token corpus instead: `--out DIR [--config FILE]`; `--out x --help` lists its options.)
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dflash_dist.config import Range
from dflash_dist.data.records import sniff
from dflash_dist.data.regen.engine import EngineSpec, Sampling
from dflash_dist.data.regen.engines import default_engine
from dflash_dist.data.regen.run import Job, Shard, exit_code_of, run
from dflash_dist.exits import record_exit_code
from dflash_dist.io.files import check_output_path

log = logging.getLogger("dflash_dist.data.regenerate")


def number(kind: type, **bounds: float):
    """An argparse type for a numeric flag that declares its range once (config.Range, as the config keys'
    `num`): a value outside it is refused by argparse (exit 2, naming the flag) before any work."""
    rng = Range(**bounds)

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not rng.allows(v):
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.data.regenerate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model directory (weights, config, tokenizer)")
    ap.add_argument("--input", required=True, help="chat JSONL to regenerate")
    ap.add_argument("--output", required=True, help="chat JSONL to write (same schema)")
    ap.add_argument("--tokenizer", help="tokenizer directory with the chat template (default: --target)")
    ap.add_argument("--engine", choices=("vllm", "hf"), default=None,
                    help="vllm (the default where it is installed) or hf (transformers)")
    ap.add_argument("--max-new-tokens", type=number(int, ge=1), default=2048, help="longest reply, in tokens")
    ap.add_argument("--temperature", type=number(float, ge=0), default=0.0, help="0 (the default): greedy")
    ap.add_argument("--top-p", type=number(float, gt=0, le=1), default=1.0)
    ap.add_argument("--seed", type=number(int, ge=0), default=0, help="sampling seed (each reply: seed, line, turn)")
    think = ap.add_mutually_exclusive_group()
    think.add_argument("--enable-thinking", dest="thinking", action="store_true", default=None,
                       help="pass enable_thinking=true to the chat template (Qwen3-style)")
    think.add_argument("--no-thinking", dest="thinking", action="store_false",
                       help="pass enable_thinking=false to the chat template")
    ap.add_argument("--on-length", choices=("drop", "keep"), default="drop",
                    help="a reply cut at --max-new-tokens: drop the conversation (default) or keep it cut")
    ap.add_argument("--chunk-size", type=number(int, ge=1), default=2000, help="input lines per resumable chunk")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, the checkpoint's dtype on GPUs")
    ap.add_argument("--max-model-len", type=number(int, ge=0), default=0, help="context of the engine (0: the target's)")
    ap.add_argument("--tensor-parallel", type=number(int, ge=1), default=1, help="GPUs per engine (vllm); one rank per engine")
    ap.add_argument("--kv-cache-gib", type=number(float, gt=0), default=1.0, help="CPU only: vLLM's KV cache size")
    ap.add_argument("--gpu-memory-utilization", type=number(float, gt=0, le=1), default=0.9)
    ap.add_argument("--batch-size", type=number(int, ge=1), default=64, help="hf engine: prompts per generate call")
    ap.add_argument("--max-num-seqs", type=number(int, ge=0), default=0, help="vllm engine: sequences per step (0: vLLM's)")
    ap.add_argument("--progress-s", type=number(float, gt=0), default=30.0,
                    help="seconds between progress lines in a log")
    ap.add_argument("--heartbeat-s", type=number(float, ge=0.05), default=1.0,
                    help="under torchrun: seconds between a rank's heartbeats")
    ap.add_argument("--dead-after-s", type=number(float, ge=1), default=60.0,
                    help="under torchrun: a rank silent this long is named dead and every rank exits 3")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return ap


def job_from_args(args: argparse.Namespace) -> Job:
    """The job the flags describe (their ranges were checked as they were parsed)."""
    if args.dead_after_s < 3 * args.heartbeat_s:  # one late beat of a busy host is no death (as dist.dead_after_s)
        raise ValueError(f"--dead-after-s must be >= 3 x --heartbeat-s, got {args.dead_after_s:g} and "
                         f"{args.heartbeat_s:g}")
    spec = EngineSpec(name=args.engine or default_engine(), target=args.target, tokenizer=args.tokenizer or args.target,
                      dtype=args.dtype, max_model_len=args.max_model_len, tensor_parallel=args.tensor_parallel,
                      kv_cache_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization,
                      batch_size=args.batch_size, max_num_seqs=args.max_num_seqs)
    return Job(input=Path(args.input), output=Path(args.output), engine=spec,
               sampling=Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed),
               on_length=args.on_length, enable_thinking=args.thinking, chunk_size=args.chunk_size,
               progress_s=args.progress_s, heartbeat_s=args.heartbeat_s, dead_after_s=args.dead_after_s)


def check_paths(job: Job, overwrite: bool) -> None:
    if not job.input.is_file():
        raise FileNotFoundError(f"--input {job.input}: file not found")
    if (looks := sniff(job.input)) is not None:  # read line by line it would be all bad_json skips
        raise ValueError(f"--input {job.input}:1: not a JSONL file: it looks like {looks} (regeneration reads "
                         "JSONL; data.prepare also reads parquet and `datasets` directories)")
    if not Path(job.engine.target).is_dir():
        raise FileNotFoundError(f"--target {job.engine.target}: directory not found")
    if job.output.exists() and not overwrite:
        raise FileExistsError(f"--output {job.output} already exists (pass --overwrite to replace it)")
    check_output_path(job.output, "--output")  # a missing or read-only directory: now, not after the run


def main(argv: list[str] | None = None, engine=None) -> int:
    """`engine`: one already built for these flags (the tests share one engine between runs)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # a flag out of its range (argparse said which: exit 2), or --help (0)
        return record_exit_code(exc.code if isinstance(exc.code, int) else 2)
    shard = Shard.from_env()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank{shard.rank}] %(levelname)s %(name)s: "
                                                   "%(message)s")
    try:
        job = job_from_args(args)
        check_paths(job, args.overwrite)
        code = run(job, shard, engine)
    except Exception as exc:
        code = exit_code_of(exc)
        if code == 1:
            raise  # not an input or a peer: the traceback says where
        log.error("rank %d: %s", shard.rank, exc)
    return record_exit_code(code)  # for launch/regenerate.sh: torchrun's own code after a signal is 1


if __name__ == "__main__":
    sys.exit(main())
