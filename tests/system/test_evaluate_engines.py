"""The same export and prompt sets (conversations and token ids) through the hf engine on one rank, on two
torchrun ranks (gloo), and served by vLLM's DFlash speculative decoding: the counts agree.

vLLM is part of CI's install (VLLM=1 bash launch/setup.sh): a missing vllm fails here, it never skips.
One vLLM command (three engines: target-only, n-gram and DFlash) per module; real processes, hard timeouts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from evaluate_fixtures import TURNS, make_export, target_overrides, write_jsonl

# Engine start-ups (three vLLM engines, one after the other) and torchrun: about 3 minutes on a shared
# 2-core machine (4.5 at load 12) with one vLLM engine less.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

IDS = [[3, 17, 42, 99, 5, 8, 60], [11, 22, 23, 7, 90, 31, 44, 12, 19, 64, 1, 77], [120, 5, 6],
       [40, 41, 42, 43, 44, 45, 46, 47]]
TIMING = ("tokens_per_s", "speedup")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    model_dir, draft = make_export(root)
    sets = [str(write_jsonl(root / "chat.jsonl", TURNS)), str(write_jsonl(root / "ids.jsonl", IDS))]
    return root, model_dir, draft, sets


def evaluate(setup, out_name: str, engine: str, nproc: int = 1, extra=(), timeout: float = 600) -> dict:
    root, model_dir, draft, sets = setup
    out = root / out_name
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "dflash_dist.evaluate", "--draft", str(draft), "--bench", sets[0], "--bench", sets[1],
           "--engine", engine, "--json", str(out), "--max-new-tokens", "40", *extra, *target_overrides(model_dir)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    return json.loads(out.read_text())


def counts(result: dict) -> dict:
    """Everything but the timings (which differ from run to run) and the run's own description."""
    return {name: {k: v for k, v in s.items() if k not in TIMING}
            for name, s in [*result["sets"].items(), ("overall", result["overall"])]}


@pytest.fixture(scope="module")
def hf_one_rank(setup):
    return evaluate(setup, "hf1.json", "hf", extra=["--strict"])


def test_two_ranks_give_the_one_rank_result(setup, hf_one_rank):
    two = evaluate(setup, "hf2.json", "hf", nproc=2, extra=["--strict"])
    assert two["ranks"] == 2 and hf_one_rank["ranks"] == 1
    assert counts(two) == counts(hf_one_rank)
    assert hf_one_rank["overall"]["exact"] and hf_one_rank["overall"]["num_turns"] == 6 + len(IDS)


@pytest.fixture(scope="module")
def vllm_result(setup):
    """The drafter and both baselines (three engines, one after the other) in one command."""
    return evaluate(setup, "vllm.json", "vllm", extra=["--kv-cache-gib", "0.25", "--max-model-len", "1024", "--baselines"],
                    timeout=1200)


def rows(doc: dict) -> dict:
    return {**doc["sets"], "overall": doc["overall"]}


def test_vllm_serves_the_export_with_the_hf_engines_acceptance(vllm_result, hf_one_rank):
    """Also the check of how verify steps are counted (the engine's step loop, every step): DFlash
    proposes at every step, so the count must equal the hf decoder's, step for step."""
    vl = vllm_result
    assert vl["engine"] == "vllm" and vl["block_size"] == hf_one_rank["block_size"] == 4
    for name in ("chat", "ids", "overall"):
        v, h = vl["sets"][name] if name != "overall" else vl["overall"], \
            hf_one_rank["sets"][name] if name != "overall" else hf_one_rank["overall"]
        assert v["accepted_per_position"] == h["accepted_per_position"], name
        assert v["num_steps"] == h["num_steps"] and v["new_tokens"] == h["new_tokens"], name
        assert abs(v["tau"] - h["tau"]) <= 0.01 * h["tau"], name
        assert v["exact"] and v["speedup"] > 0, name  # vLLM's speculative output == its target-only output
    assert sum(vl["overall"]["accepted_per_position"]) > 0  # a drafter that is right some of the time
    assert vl["overall"]["output_digest"] == hf_one_rank["overall"]["output_digest"]
    assert vl["overall"]["proposal_steps"] == vl["overall"]["num_steps"]  # vLLM's count: a draft every step


def test_target_only_baseline_is_greedy_one_token_per_step(vllm_result, hf_one_rank):
    """vLLM's target-only row: its answers are the hf engine's (--strict: the target's greedy output),
    every verify step commits exactly one token (tau 1), and nothing is proposed."""
    target = rows(vllm_result["baselines"]["target"])
    for name, h in rows(hf_one_rank).items():
        t = target[name]
        assert t["output_digest"] == h["output_digest"] and t["new_tokens"] == h["new_tokens"], name
        assert t["tau"] == 1.0 and t["accepted_per_position"] == [0, 0, 0] and t["proposal_steps"] == 0, name
        assert t["num_steps"] == t["new_tokens"] - t["num_turns"] > 0, name  # each answer's first token: its prefill
        assert t["exact"] and t["speedup"] == 1.0, name


def test_ngram_baseline_counts_every_verify_step(vllm_result):
    """n-gram prompt lookup proposes only where the context's last 2-4 tokens occurred before: tau per
    verify step counts the steps without a proposal too. Each step commits 1 + its accepted drafts, and
    only an answer's last step can be cut (at a stop token or the length, its acceptance still counted
    whole), so the steps follow from the tokens and vLLM's accepted count, within B - 1 per answer."""
    B = vllm_result["block_size"]
    target = rows(vllm_result["baselines"]["target"])
    for name, n in rows(vllm_result["baselines"]["ngram"]).items():
        accepted = sum(n["accepted_per_position"])
        uncut = n["new_tokens"] - n["num_turns"] - accepted  # the steps if no answer's last step was cut
        assert uncut <= n["num_steps"] <= uncut + (B - 1) * n["num_turns"], (name, n)
        assert n["tau"] == pytest.approx(1 + accepted / n["num_steps"]), name
        assert n["output_digest"] == target[name]["output_digest"] and n["exact"], name
    overall = vllm_result["baselines"]["ngram"]["overall"]
    # Random prompts and a random target: many steps find no earlier n-gram, and they are counted.
    assert 0 < overall["proposal_steps"] < overall["num_steps"], overall
    assert sum(overall["accepted_per_position"]) > 0, overall  # and some lookups are right


