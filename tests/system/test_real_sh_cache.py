"""launch/real.sh's stage cache and its up-front checks, with the costly stage tools (regeneration, prepare,
training's torchrun, evaluation, report) swapped for stand-ins that write what their stage leaves: the
recipe's own logic runs for real, as do data.sources, from_gguf's cache check and the training override
check. Through PYBIN, as tests/integration/test_run_sh.py swaps run.sh's torchrun."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REAL_SH = ROOT / "launch" / "real.sh"

# Each stand-in writes its stage's outputs and one line to $FAKE_LOG; FAKE_NO_OUTPUT=hf makes the hf
# evaluation exit 0 without its JSON (a tool that lies). The regeneration refuses what its real command
# line refuses (its own parser); torchrun what train refuses (the project's config loader), writing
# every rank's exit code as run.sh expects.
STAND_IN = """import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
def opt(name):
    return argv[argv.index(name) + 1]
def log(line):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(line + "\\n")
tool = argv[argv.index("-m") + 1] if "-m" in argv else None
if os.environ["STAND_IN_AS"] == "torchrun":
    from dflash_dist.config import ConfigError, load_config
    args = argv[argv.index("dflash_dist.train") + 1:]
    overrides = [a for a in args[2:] if "=" in a]
    nproc = int(next(a for a in argv if a.startswith("--nproc_per_node=")).split("=")[1])
    try:
        cfg = load_config(args[1], overrides)
        code = 0
    except ConfigError as exc:
        sys.stderr.write(f"ERROR: {exc}\\n")
        code = 2
    for r in range(nproc):
        Path(os.environ["DFLASH_EXIT_CODE_DIR"], f"local-rank-{r}").write_text(str(code))
    if code:
        sys.exit(1)
    run = Path(cfg.train.run_dir)
    mine = [a for a in overrides if a.startswith("train.epochs=")]
    log("train " + " ".join(mine))
    (run / "checkpoints" / "step-1").mkdir(parents=True, exist_ok=True)
    (run / "export").mkdir(exist_ok=True)
    (run / "export" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\\n")
    (run / "summary.json").write_text(json.dumps({"overrides": mine}))
elif tool == "dflash_dist.data.regenerate":
    from dflash_dist.data.regen.cli import parser
    parser().parse_args(argv[2:])  # refuses (exit 2) what the real one refuses
    log("regenerate")
    Path(opt("--output")).write_text(Path(opt("--input")).read_text())
elif tool == "dflash_dist.data.prepare":
    log("prepare")
    Path(opt("--output")).mkdir(parents=True, exist_ok=True)
    Path(opt("--output"), "meta.json").write_text("{}")
elif tool == "dflash_dist.evaluate":
    engine = opt("--engine")
    log("evaluate " + engine)
    if os.environ.get("FAKE_NO_OUTPUT") != engine:
        Path(opt("--json")).write_text("{}")
elif tool == "dflash_dist.report":
    log("report")
else:
    os.execv(sys.executable, [sys.executable, *argv])
"""


@pytest.fixture
def fake(tmp_path):
    """(run dir, environment): PYBIN holding the stand-ins, the run's target taken as converted from the
    packaged GGUF (its from_gguf.json: from_gguf's own cache keeps it, nothing converted)."""
    from dflash_dist.models.from_gguf import fingerprint, packaged_smollm2

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "stand_in.py").write_text(STAND_IN)
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(
            f'#!/bin/bash\nSTAND_IN_AS={name} exec {sys.executable} {bin_dir}/stand_in.py "$@"\n')
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "real"
    (run / "target").mkdir(parents=True)
    gguf = packaged_smollm2()
    (run / "target" / "from_gguf.json").write_text(json.dumps({"source": str(gguf), **fingerprint(gguf)}))
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "STOP_AFTER", "GGUF")}
    env.update(SKIP_SETUP="1", PYBIN=str(bin_dir), FAKE_LOG=str(tmp_path / "calls.log"), TRAIN_CONVS="3",
               HELDOUT="2", HUMANEVAL="2", HF_PROMPTS="1", OMP_NUM_THREADS="1")
    return run, env


def recipe(run: Path, env: dict, *args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REAL_SH), f"train.run_dir={run}", *args], cwd=ROOT,
                          env={**env, **settings}, capture_output=True, text=True, timeout=120)


def calls(env: dict) -> list[str]:
    log = Path(env["FAKE_LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def tree(run: Path) -> dict:
    """Every file under run with its size and modification time: what a refused run must leave alone."""
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))}


@pytest.mark.parametrize("settings,args,message", [
    ({"MAX_NEW_TOKENS": "abc"}, [], "MAX_NEW_TOKENS=abc: expected a whole number >= 1"),
    ({"ON_LENGTH": "cut"}, [], "ON_LENGTH=cut: expected drop or keep"),
    ({"KV_CACHE_GIB": "0"}, [], "KV_CACHE_GIB=0: expected a number of GiB > 0"),
    ({}, ["train.epochs=abc"], "config key 'train.epochs'"),
    ({}, ["train.nope=1"], "config key 'train.nope'"),
    ({"NPROC": "1"}, [], "NPROC=1: training needs at least 2 ranks"),
])
def test_a_refused_setting_leaves_the_finished_stages_alone(fake, settings, args, message):
    """Regeneration and training finished; a value their stage would refuse is refused before the stage
    cache moves or deletes anything (today's stage cache redid regeneration or set the training aside
    first, and only then did the stage refuse the value)."""
    run, env = fake
    done = recipe(run, env, "train.epochs=1", STOP_AFTER="training")
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls(env) == ["regenerate", "prepare", "train train.epochs=1"]
    before = tree(run)
    r = recipe(run, env, "train.epochs=1", *args, STOP_AFTER="training", **settings)
    assert tree(run) == before and calls(env) == [], r.stdout + r.stderr
    assert r.returncode == 2 and message in r.stderr, r.stdout + r.stderr


def test_settings_a_b_a_c_all_run_and_nothing_set_aside_is_lost(fake):
    """A, B, A, C: the third run finds A's outputs set aside and brings them back (no training); the fourth
    sets A aside again (today: `mv` failed on the superseded folder A's first move had left)."""
    run, env = fake
    for epochs, trained in (("1", True), ("2", True), ("1", False), ("3", True)):
        r = recipe(run, env, f"train.epochs={epochs}", STOP_AFTER="training")
        assert r.returncode == 0, r.stdout + r.stderr
        assert ("train train.epochs=" + epochs in calls(env)) == trained, r.stdout
        assert json.loads((run / "summary.json").read_text())["overrides"] == [f"train.epochs={epochs}"]
        assert (run / ".recipe-train-done").read_text() == (run / ".recipe-train-key").read_text()
    aside = {json.loads((d / "summary.json").read_text())["overrides"][0]: d for d in (run / "superseded").iterdir()}
    assert sorted(aside) == ["train.epochs=1", "train.epochs=2"], aside
    for d in aside.values():
        assert (d / "checkpoints" / "step-1").is_dir() and (d / "export" / "config.json").is_file()
        assert (d / ".recipe-train-done").is_file()


def test_a_folder_already_set_aside_under_the_key_is_never_overwritten(fake):
    """superseded/KEY there already (left by an earlier recipe): the outputs of KEY go beside it, and come
    back from there when their settings return (today `mv` replaced its files)."""
    run, env = fake
    assert recipe(run, env, "train.epochs=1", STOP_AFTER="training").returncode == 0
    first = (run / ".recipe-train-key").read_text().strip()
    earlier = run / "superseded" / first
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text('{"overrides": ["earlier"]}')
    r = recipe(run, env, "train.epochs=2", STOP_AFTER="training")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (earlier / "summary.json").read_text() == '{"overrides": ["earlier"]}'
    moved = run / "superseded" / f"{first}.1"
    assert json.loads((moved / "summary.json").read_text())["overrides"] == ["train.epochs=1"]
    calls(env)
    r = recipe(run, env, "train.epochs=1", STOP_AFTER="training")
    assert r.returncode == 0 and calls(env) == [], r.stdout + r.stderr
    assert json.loads((run / "summary.json").read_text())["overrides"] == ["train.epochs=1"]
    assert not moved.exists() and (earlier / "summary.json").is_file()


@pytest.mark.parametrize("name,value,message", [
    ("HF_PROMPTS", "abc", "expected a whole number >= 0"),
    ("HF_PROMPTS", "-1", "expected a whole number >= 0"),
    ("TRAIN_CONVS", "0", "expected a whole number >= 1"),
    ("HELDOUT", "4x", "expected a whole number >= 1"),
    ("TURNS", "one", "expected a whole number >= 1"),
    ("SEED", "1.5", "expected a whole number >= 0"),
    ("MAX_TURN_CHARS", "2k", "expected a whole number >= 1"),
    ("EVAL_NEW_TOKENS", "0", "expected a whole number >= 1"),
    ("HUMANEVAL", "all", "expected a whole number >= 1"),
    ("NPROC", "three", "expected a whole number >= 1"),
    ("KV_CACHE_GIB", "1GiB", "expected a number of GiB > 0"),
])
def test_a_bad_numeric_setting_exits_2_before_any_stage(tmp_path, name, value, message):
    """Today HF_PROMPTS=abc skipped the hf evaluation (`[ abc -gt 0 ]` is false), marked the stage done and
    exited 0."""
    run = tmp_path / "real"
    r = subprocess.run(["bash", str(REAL_SH), f"train.run_dir={run}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "SKIP_SETUP": "1", name: value}, timeout=60)
    assert r.returncode == 2 and f"launch/real.sh: {name}={value}: {message}" in r.stderr, r.stderr
    assert not run.exists()


def test_a_stage_is_marked_done_only_when_its_output_is_there(fake):
    """An hf evaluation that exits 0 without hf.json fails the recipe and leaves the stage to redo."""
    run, env = fake
    r = recipe(run, env, "train.epochs=1", STOP_AFTER="evaluation", FAKE_NO_OUTPUT="hf")
    assert r.returncode == 1 and "eval/hf.json is missing after its stage ended" in r.stderr, r.stdout + r.stderr
    assert not (run / "eval" / ".recipe-done").exists()
    calls(env)
    r = recipe(run, env, "train.epochs=1", STOP_AFTER="evaluation")
    assert r.returncode == 0 and (run / "eval" / "hf.json").is_file(), r.stdout + r.stderr
    assert calls(env) == ["evaluate vllm", "evaluate hf"]


@pytest.mark.slow  # one real conversion of SmolLM2-135M (0.5-2 minutes on a CPU)
@pytest.mark.timeout(600)
def test_another_gguf_converts_the_target_again_and_redoes_what_follows(fake, tmp_path):
    """A run whose target came from the packaged GGUF, then GGUF=another file (the packaged one with bytes
    appended: another SHA-256, the same model): the target is converted from the new file and the
    regeneration, which holds the target's key, is redone (today from_gguf refused, exit 2)."""
    from dflash_dist.models.from_gguf import packaged_smollm2

    run, env = fake
    r = recipe(run, env, STOP_AFTER="regeneration")
    assert r.returncode == 0 and calls(env) == ["regenerate"], r.stdout + r.stderr
    other = tmp_path / "other.gguf"
    other.write_bytes(packaged_smollm2().read_bytes() + bytes(32))
    r = recipe(run, env, STOP_AFTER="regeneration", GGUF=str(other))
    assert r.returncode == 0, r.stdout + r.stderr
    marker = json.loads((run / "target" / "from_gguf.json").read_text())
    assert marker["source"] == str(other) and (run / "target" / "config.json").is_file()
    assert "regeneration: inputs or settings changed: redoing" in r.stdout and calls(env) == ["regenerate"]
