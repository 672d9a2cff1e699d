"""bash launch/real.sh end to end on a small slice: GGUF -> target directory -> ShareGPT slice -> replies
regenerated through vLLM -> prepare -> train (one short epoch) -> evaluate with both engines -> report."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The smallest slice that still runs every stage: 12 conversations, 24-token replies, 2 prompts per set
# (the start-ups of its four vLLM engines do not shrink with it; the hf engine decodes each answer twice).
SMALL = {"SKIP_SETUP": "1", "TRAIN_CONVS": "12", "HELDOUT": "2", "HUMANEVAL": "2", "MAX_NEW_TOKENS": "24",
         "EVAL_NEW_TOKENS": "24", "HF_PROMPTS": "2", "KV_CACHE_GIB": "0.5"}
OVERRIDES = ["train.epochs=1", "train.eval_prompts=1", "train.eval_new_tokens=8"]


def recipe(run: Path, timeout: int):
    return subprocess.run(["bash", "launch/real.sh", f"train.run_dir={run}", *OVERRIDES], cwd=ROOT,
                          env={**os.environ, **SMALL}, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_the_real_recipe_end_to_end_then_cached(tmp_path, smollm2_target):
    run = tmp_path / "real"
    run.mkdir()
    # the suite's converted target stands for the conversion (tests/test_from_gguf.py tests that): real.sh
    # finds it done (same GGUF SHA-256) and keeps it
    (run / "target").symlink_to(smollm2_target, target_is_directory=True)
    r = recipe(run, timeout=2100)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-8000:]

    regen = (run / "regen" / "chats.jsonl").read_text().splitlines()
    assert len(regen) == 12  # ON_LENGTH=keep: a cut reply stays (trained as cut), none dropped
    prepared = json.loads((run / "prepared" / "meta.json").read_text())
    assert prepared["num_samples"] + sum(prepared["skipped"].values()) == 12 and prepared["num_samples"] > 0
    assert (run / "export" / "config.json").is_file() and (run / "export" / "model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())
    assert (run / "report" / "index.html").is_file()

    vllm = json.loads((run / "eval" / "vllm.json").read_text())
    hf = json.loads((run / "eval" / "hf.json").read_text())
    assert sorted(vllm["sets"]) == sorted(hf["sets"]) == ["heldout", "humaneval"]
    for name in vllm["sets"]:  # the serving contract on a real target: both engines count the same
        v, h = vllm["sets"][name], hf["sets"][name]
        assert v["num_prompts"] == h["num_prompts"] == 2
        for k in ("num_steps", "new_tokens", "accepted_per_position", "histogram"):
            assert v[k] == h[k], (name, k, v[k], h[k])
        assert h["exact"]
    assert set(vllm["baselines"]) == {"target", "ngram"}
    # the closing table: every set, the drafter beside both baselines
    table = r.stdout[r.stdout.index("tau (tokens per target verify step)"):]
    for word in ("heldout", "humaneval", "overall", "dflash (vllm)", "ngram (vllm)", "target (vllm)", "dflash (hf"):
        assert word in table, table

    # a rerun finds every stage done and redoes none
    again = recipe(run, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    for stage in ("sources", "regeneration", "prepare", "training", "evaluation"):
        assert f"{stage}: done, kept" in again.stdout, again.stdout
    assert "running ->" not in again.stdout


@pytest.mark.parametrize("env,args,message", [
    ({}, ["epochs"], "epochs: expected key=value training overrides"),
    ({"PRESET": "huge"}, [], "PRESET=huge: expected default or long"),
    ({"CONFIG": "configs/nope.yaml"}, [], "CONFIG=configs/nope.yaml: no such file"),
    ({"STOP_AFTER": "lunch"}, [], "STOP_AFTER=lunch: expected target, sources"),
])
def test_bad_arguments_exit_2_before_any_stage(tmp_path, env, args, message):
    r = subprocess.run(["bash", "launch/real.sh", f"train.run_dir={tmp_path / 'real'}", *args], cwd=ROOT,
                       env={**os.environ, "SKIP_SETUP": "1", **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "real").exists()


def test_a_stage_is_kept_on_a_rerun_and_redone_when_its_settings_change(tmp_path, smollm2_target):
    run = tmp_path / "real"
    run.mkdir()
    (run / "target").symlink_to(smollm2_target, target_is_directory=True)

    def sources(n):
        env = {**os.environ, "SKIP_SETUP": "1", "STOP_AFTER": "sources", "TRAIN_CONVS": str(n), "HELDOUT": "2"}
        r = subprocess.run(["bash", "launch/real.sh", f"train.run_dir={run}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout, (run / "sources" / "train.jsonl").read_text().splitlines()

    out, train = sources(5)
    assert "sources: running ->" in out and len(train) == 5 and "STOP_AFTER=sources: stopping here" in out
    assert not (run / "regen").exists()
    out, again = sources(5)
    assert "sources: done, kept" in out and again == train
    out, more = sources(7)
    assert "sources: inputs or settings changed: redoing" in out and len(more) == 7
