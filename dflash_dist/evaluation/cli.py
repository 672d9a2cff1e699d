"""python -m dflash_dist.evaluate: acceptance length (tau), acceptance per position, histogram and speedup
of an exported drafter against its target, per prompt set and overall, by one of two engines:
  --engine hf    the project's KV-cached draft-then-verify decoder (exact: its output must equal the
                 target's greedy output; --strict fails on a mismatch); under torchrun the prompts are
                 split over the ranks (one GPU each) and rank 0 reports;
  --engine vllm  vLLM's DFlash speculative decoding serving the export (figures from vLLM's metrics);
                 --baselines adds target-only decoding and vLLM's n-gram prompt lookup on the same prompts.
Prompt sets: --bench FILE.jsonl ({"turns": [...]} conversations through the target's chat template, or
token-id lists), --bench NAME (gsm8k, math500, humaneval, mbpp, mt-bench), repeatable; default: the
synthetic held-out set of the tiny job. Bad input (a flag, file, line or export) exits 2, naming it.

  python -m dflash_dist.evaluate --draft EXPORT [--config FILE] [key=value ...] [--bench FILE|NAME ...]
      [--engine hf|vllm] [--json OUT.json] [--max-new-tokens N] [--num-prompts N] [--enable-thinking]
      [--baselines] [--kv-cache-gib G]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from pathlib import Path

import torch

from dflash_dist.evaluation.prompts import EvalInputError, PromptSet, default_bench_dir, load_bench
from dflash_dist.io.files import check_output_path

log = logging.getLogger(__name__)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dflash_dist.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="exported drafter directory (config.json, model.safetensors)")
    ap.add_argument("--config", help="YAML config of the run (it fixes the target)")
    ap.add_argument("--bench", "--prompts", dest="bench", action="append", default=[],
                    help="prompt set: a JSONL file or a benchmark name; repeatable")
    ap.add_argument("--bench-dir", type=Path, default=None,
                    help="where named benchmarks are cached as NAME.jsonl (default $DFLASH_BENCH_DIR or "
                         "~/.cache/dflash_dist/benchmarks)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--json", help="write the result document here")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per answer (each turn)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="first N prompts of each set (default: all; 32 of the synthetic held-out set)")
    ap.add_argument("--enable-thinking", dest="thinking", action="store_true", default=False,
                    help="chat template's thinking mode on (templates that read enable_thinking)")
    ap.add_argument("--no-thinking", dest="thinking", action="store_false", help="thinking off (the default)")
    ap.add_argument("--strict", action="store_true", help="hf engine: fail if speculative output differs from greedy")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5,
                    help="vllm on CPU: KV cache size in GiB (the same flag and unit as regeneration's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="vllm: context length (default: the model's; on CPU one sequence of it must fit --kv-cache-gib)")
    ap.add_argument("--baselines", action="store_true",
                    help="vllm: also decode the same prompts with vLLM's n-gram prompt lookup, and report it and "
                         "target-only decoding (tau per verify step, tokens/s) beside the drafter")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    return ap.parse_args(argv)


def check_flags(args) -> None:
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--num-prompts", args.num_prompts),
                        ("--kv-cache-gib", args.kv_cache_gib), ("--max-model-len", args.max_model_len)):
        if value is not None and value <= 0:
            raise EvalInputError(f"{flag} {value}: must be a positive number")
    if args.baselines and args.engine != "vllm":
        raise EvalInputError("--baselines: the baselines are vLLM's decoders; use it with --engine vllm")
    if args.json:  # before the evaluation (minutes to hours), not after it
        check_output_path(args.json, "--json")


def prompt_sets(args, cfg) -> list[PromptSet]:
    from dflash_dist.config import ConfigError
    if not args.bench:
        if cfg.data.path:
            raise ConfigError("a prepared dataset has no held-out split here: pass --bench FILE.jsonl")
        from dflash_dist.evaluation.heldout import heldout_set
        return [heldout_set(cfg, args.num_prompts or 32)]
    sets, names = [], set()
    for spec in args.bench:
        pset = load_bench(spec, args.bench_dir or default_bench_dir()).limit(args.num_prompts)
        while pset.name in names:  # two files of the same name in different directories
            pset.name += "'"
        names.add(pset.name)
        sets.append(pset)
    return sets


def init_ranks(timeout_s: float) -> tuple[int, int, torch.device]:
    """(rank, world, device): torchrun's ranks (one GPU each, or gloo on CPU) or a single process."""
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # small ops one token at a time: extra threads only synchronise
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device


def setup_logging(rank: int, world: int) -> None:
    tag = f"[rank{rank} evaluate] " if world > 1 else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # a no-op where logging is set up already (tests)


def make_chat(cfg, sets: list[PromptSet], thinking: bool):
    """The target's tokenizer, when some set is text (a tiny target has none)."""
    if not any(s.kind == "turns" for s in sets):
        return None
    if cfg.model.target.kind != "hf":
        bad = next(s for s in sets if s.kind == "turns")
        raise EvalInputError(f"{bad.source}: conversation prompts need a transformers target with a tokenizer "
                             "(model.target.kind=hf model.target.path=DIR)")
    from dflash_dist.evaluation.chat import Chat
    return Chat(cfg.model.target.path, thinking)


def run_hf(args, cfg, sets, rank: int, world: int, device: torch.device) -> dict | None:
    from dflash_dist.evaluation.hf_engine import Options, run_sets
    from dflash_dist.evaluation.loading import check_config_agrees, load_for_eval, read_export_config
    from dflash_dist.evaluation.results import report
    target, drafter = load_for_eval(args.draft, cfg, device)
    check_config_agrees(read_export_config(args.draft), cfg, args.overrides, args.draft)
    for s in sets:
        s.check_vocab(target.vocab_size)
    chat = make_chat(cfg, sets, args.thinking)
    tallies = run_sets(target, drafter, sets, chat, Options(args.max_new_tokens, args.strict), rank, world)
    if tallies is None:
        return None
    return report("hf", drafter.spec.block_size, tallies, ranks=world, device=device.type,
                  max_new_tokens=args.max_new_tokens, thinking=args.thinking, draft=str(args.draft))


def run_vllm(args, cfg, sets) -> dict:
    from dflash_dist.evaluation.loading import read_export_config
    from dflash_dist.evaluation.results import report
    from dflash_dist.evaluation.vllm_engine import VllmOptions, run_sets
    from dflash_dist.models.variants import variant_of_export
    export = read_export_config(args.draft)
    variant = variant_of_export(export)
    if variant.vllm_method is None:  # before any check that needs a transformers target or vLLM itself
        raise EvalInputError(f"--draft {args.draft}: a {variant.title} drafter (dflash_config.projector_type "
                             f"{variant.projector_type!r}), which vLLM 0.32 cannot serve (its DFlash model has no such "
                             "head and refuses its weights); measure it with --engine hf, serve it with SGLang")
    if cfg.model.target.kind != "hf":
        raise EvalInputError("--engine vllm serves a transformers model directory: model.target.kind=hf "
                             "model.target.path=DIR")
    from transformers import AutoConfig

    from dflash_dist.evaluation.loading import check_fit
    text_cfg = AutoConfig.from_pretrained(cfg.model.target.path, local_files_only=True).get_text_config()
    # The hf engine's own checks, before any engine starts (minutes on a CPU, a GPU's memory on a node).
    check_fit(export, text_cfg.vocab_size, text_cfg.hidden_size, text_cfg.num_hidden_layers, args.draft)
    from dflash_dist.evaluation.loading import check_config_agrees
    check_config_agrees(export, cfg, args.overrides, args.draft)
    for s in sets:
        s.check_vocab(text_cfg.vocab_size)
    chat = make_chat(cfg, sets, args.thinking)
    from dflash_dist.evaluation.hf_engine import check_context
    context = args.max_model_len or text_cfg.max_position_embeddings
    check_context(context, sets, chat)
    opts = VllmOptions(target=cfg.model.target.path, draft=str(args.draft),
                       block_size=variant.drafts(int(export["block_size"])) + 1, method=variant.vllm_method,
                       context=context, dtype=cfg.model.target.dtype, kv_cache_gib=args.kv_cache_gib,
                       max_model_len=args.max_model_len, baselines=args.baselines)
    tallies, baselines = run_sets(opts, sets, chat, args.max_new_tokens)
    return report("vllm", opts.block_size, tallies, baselines, ranks=1, device="cuda" if torch.cuda.is_available() else "cpu",
                  max_new_tokens=args.max_new_tokens, thinking=args.thinking, draft=str(args.draft))


def export_variant(args) -> list[str]:
    """`model.draft.variant=<the export's>` where neither --config nor the overrides name a variant: the
    config's `variant` section is then the export's variant's options (`variant.gru_hidden_dim=16` on a
    Domino export is read as Domino's, and `check_config_agrees` names it if it contradicts the export)."""
    from omegaconf import OmegaConf

    from dflash_dist.evaluation.loading import read_export_config
    from dflash_dist.models.variants import variant_of_export
    named = any(o.split("=", 1)[0].lstrip("+~") == "model.draft.variant" for o in args.overrides or [])
    if not named and args.config:
        try:
            named = OmegaConf.select(OmegaConf.load(args.config), "model.draft.variant") is not None
        except Exception:  # a missing or broken file: load_config names it
            return []
    if named:
        return []
    return [f"model.draft.variant={variant_of_export(read_export_config(args.draft)).name}"]


def evaluate(args, rank: int, world: int, device: torch.device) -> dict | None:
    from dflash_dist.config import load_config
    from dflash_dist.models import variants  # noqa: F401  the variants' config rules and renamed keys, before loading
    check_flags(args)
    cfg = load_config(args.config, [*export_variant(args), *args.overrides])
    sets = prompt_sets(args, cfg)
    if args.engine == "vllm":
        if world > 1:
            raise EvalInputError("--engine vllm runs in one process (vLLM spreads a model over GPUs itself): "
                                 "start it without torchrun")
        return run_vllm(args, cfg, sets)
    return run_hf(args, cfg, sets, rank, world, device)


def main(argv=None) -> int:
    from dflash_dist.config import ConfigError
    from dflash_dist.evaluation.hf_engine import SpeculativeMismatch
    from dflash_dist.evaluation.results import save, table
    args = parse_args(argv)
    rank, world, device = init_ranks(timeout_s=600.0)
    setup_logging(rank, world)
    try:
        result = evaluate(args, rank, world, device)
    except (ConfigError, EvalInputError, ValueError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 2
    except SpeculativeMismatch as exc:
        log.error("--strict: %s", exc)
        return 1
    finally:
        if world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
    if result is not None:  # rank 0
        sys.stdout.write(table(result))
        if args.json:
            save(result, args.json)
            log.info("result written to %s", args.json)
    return 0
