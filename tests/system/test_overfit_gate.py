"""The overfit gate: the whole train/serve contract on the real SmolLM2-135M-Instruct target.

A drafter trained until it has memorised a handful of conversations whose replies the target itself
regenerated greedily must, on the same prompts, propose what the target says next: served by the
project's decoder (--engine hf) and by vLLM's DFlash speculative decoding (--engine vllm), nearly every
drafted position of nearly every verify step is accepted. Exact-equality tests on random weights pass
with any drafter; this one fails on any contract bug that makes training and serving disagree (labels
shifted by one, positions, feature layer ids, the mask token, the chat template, a prompt rendered
differently for training and for serving), since each costs the memorised drafter its acceptance.
(SpecForge runs the same kind of check: one sample trained until its served acceptance is a full block.)

The pipeline is the user's: data.regenerate (hf engine, greedy, float32) -> data.prepare -> torchrun
training (1 drafter, 1 target rank) -> export -> dflash_dist.evaluate with both engines.

Threshold: a memorised drafter knows every reply token the target said in training, so a verify step can
fail only where training said nothing: past a reply's end (a block reaching beyond the end-of-turn, or
beyond a cut reply's last token, has no label there). That is at most an answer's last step, so every
drafted position must be accepted in at least num_steps - num_turns of the verify steps: anything less
is a step inside a memorised reply going wrong, which is what a contract bug does (it costs most steps,
not one). Reached on CPU (with train.epochs=120; the training accuracy was 1.00 from epoch 76 on, hence
100 here): every position of every verify step accepted, 17/17/17 of 17 steps, tau 4.0 of B = 4.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TORCHRUN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

BLOCK = 4
MAX_NEW = 24
# Short questions with short, fixed answers: replies of about 10-24 tokens.
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "What is 7 times 8?", "Say hello in Spanish."]
TRAIN = ["wandb.mode=disabled", "monitor.interval_s=5", "dist.timeout_s=300", "train.eval_prompts=0",
         f"objective.block_size={BLOCK}", "objective.num_anchors=64",  # every candidate anchor, every step
         "model.draft.num_layers=1", "optim.lr=3e-3", "optim.warmup_ratio=0.02", "optim.min_lr_ratio=0.3",
         "train.epochs=100", "train.resume=none"]


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), **kw)
    assert res.returncode == 0, (" ".join(cmd) + "\n" + res.stdout + res.stderr)[-5000:]
    return res


def target_keys(target: Path) -> list[str]:
    return ["model.target.kind=hf", f"model.target.path={target}", "model.target.dtype=float32",
            f"objective.block_size={BLOCK}"]


@pytest.fixture(scope="module")
def memorised(smollm2_target, tmp_path_factory):
    """(export directory, prompt file): the drafter trained on the target's own replies to QUESTIONS."""
    root = tmp_path_factory.mktemp("overfit")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": "-"}]}) + "\n"
                             for q in QUESTIONS))
    py = [sys.executable, "-m"]
    run([*py, "dflash_dist.data.regenerate", "--engine", "hf", "--target", str(smollm2_target), "--input", str(chats),
         "--output", str(root / "regen.jsonl"), "--max-new-tokens", str(MAX_NEW), "--on-length", "keep"], 600)
    run([*py, "dflash_dist.data.prepare", "--tokenizer", str(smollm2_target), "--input", str(root / "regen.jsonl"),
         "--output", str(root / "prepared")], 300)
    run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "dflash_dist.train", *TRAIN,
         *target_keys(smollm2_target), f"data.path={root / 'prepared'}", f"train.run_dir={root / 'run'}"], 1200)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in QUESTIONS))
    return root / "run" / "export", prompts


def evaluate(smollm2_target, memorised, engine: str, out: Path, extra=()) -> dict:
    draft, prompts = memorised
    run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(draft), "--bench", str(prompts),
         "--engine", engine, "--max-new-tokens", str(MAX_NEW), "--json", str(out), *extra,
         *target_keys(smollm2_target)], 900)
    return json.loads(out.read_text())["overall"]


def assert_memorised(r: dict, engine: str) -> None:
    """Every drafted position accepted in all verify steps but at most one per answer (module docstring)."""
    assert r["exact"] and r["num_turns"] == len(QUESTIONS), (engine, r)
    floor = r["num_steps"] - r["num_turns"]
    assert min(r["accepted_per_position"]) >= floor > 0, (engine, r["accepted_per_position"], r["num_steps"])


@pytest.fixture(scope="module")
def hf_result(smollm2_target, memorised, tmp_path_factory):
    return evaluate(smollm2_target, memorised, "hf", tmp_path_factory.mktemp("hf") / "hf.json", ["--strict"])


def test_project_decoder_accepts_nearly_the_whole_block(hf_result):
    assert_memorised(hf_result, "hf")


def test_vllm_dflash_serving_accepts_the_same(smollm2_target, memorised, hf_result, tmp_path_factory):
    vl = evaluate(smollm2_target, memorised, "vllm", tmp_path_factory.mktemp("vllm") / "vllm.json",
                  ["--kv-cache-gib", "0.25", "--max-model-len", "512"])
    assert_memorised(vl, "vllm")
    # The same contract in both engines: the same steps, accepted at the same positions.
    assert vl["accepted_per_position"] == hf_result["accepted_per_position"], (vl, hf_result)
    assert vl["num_steps"] == hf_result["num_steps"] and vl["output_digest"] == hf_result["output_digest"]
