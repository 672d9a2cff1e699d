"""Shared test helpers: run the real entry point under torchrun with a hard timeout."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# A small, fast job: every multi-process test starts from this and adds its own overrides.
TINY = [
    "wandb.mode=disabled", "monitor.interval_s=0.2", "train.epochs=3", "data.synthetic.num_samples=160",
    "data.synthetic.min_len=20", "data.synthetic.max_len=120", "plan.token_budget=1024", "plan.max_seqs=16",
    "objective.num_anchors=4", "dist.timeout_s=60", "train.eval_prompts=0",
    # Regenerated corpora are deterministic: one cache for the whole test session.
    f"data.cache_dir={Path(tempfile.gettempdir()) / 'dflash_dist_test_cache'}",
]


def torchrun(nproc: int, overrides: list[str], run_dir: Path, timeout: float = 150, env: dict | None = None):
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(torchrun_cmd(nproc, overrides, run_dir), capture_output=True, text=True, timeout=timeout,
                          env=e)


def epoch_lines(log: str) -> dict[int, list[tuple[int, str]]]:
    """rank -> [(batches, plan digest)] per epoch, from 'epoch E: N batches (plan D)' lines."""
    out: dict[int, list[tuple[int, str]]] = {}
    for m in re.finditer(r"\[rank(\d+) \w+\] \S+: epoch (\d+): (\d+) batches \(plan (\w+)\)", log):
        out.setdefault(int(m.group(1)), []).append((int(m.group(3)), m.group(4)))
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun_cmd(nproc: int, overrides: list[str], run_dir: Path) -> list[str]:
    return TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", "-m", "dflash_dist.train",
                       *TINY, f"train.run_dir={run_dir}", *overrides]


def start_torchrun(nproc: int, overrides: list[str], run_dir: Path, log_path: Path,
                   env: dict | None = None) -> subprocess.Popen:
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    f = open(log_path, "w")
    return subprocess.Popen(torchrun_cmd(nproc, overrides, run_dir), stdout=f, stderr=subprocess.STDOUT, env=e)


def wait_for(pred, timeout: float, what: str, poll: float = 0.1):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def progress_step(run_dir: Path) -> int:
    try:
        recs = metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return max((r.get("step", 0) for r in recs), default=0)


def worker_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the workers of a torchrun agent."""
    import psutil
    out = {}
    for c in psutil.Process(agent_pid).children(recursive=True):
        try:
            env = c.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            out[int(env["RANK"])] = c.pid
    return out


def final_digest(run_dir: Path) -> str:
    """The finished run's weights digest, from summary.json: every drafter's, compared over the group
    before the summary is written (`drafter_replicas_identical` says how many)."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    assert summary["drafter_replicas_identical"] == summary["num_drafters"], summary
    return summary["weights_digest"]


STARTUP_S = 300  # for every spawned rank to start (an interpreter importing torch and the test module)


def spawn(n: int, fn, *args, timeout_s: float = 120) -> list:
    """Run fn(rank, queue, *args) in n spawned processes, the n ranks of a gloo process group, and return
    the n items they put on the queue (one each).

    The rendezvous is a FileStore in a directory this call owns: no port is chosen, released and bound
    later by rank 0 (which raced every other process on the machine for it); gloo's own sockets bind
    ports the kernel picks and publish them through the store. Each rank runs one intra-op thread, as the
    in-process tests do. There is no deadline for the whole run, which a loaded machine stretches: ranks
    wait for each other's start-up for up to STARTUP_S, then `timeout_s` bounds each wait of a rank on its
    peers (gloo raises in the rank that waits). A rank that ends without its item fails the test at once,
    naming its exit code; stragglers are killed, never awaited."""
    import queue

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dflash-rendezvous-") as d:
        procs = [ctx.Process(target=_rank, args=(fn, r, n, os.path.join(d, "store"), q, timeout_s, args))
                 for r in range(n)]
        for p in procs:
            p.start()
        got, grace = [], 0.0  # a failed run's stragglers wait on the dead rank: killed at once
        try:
            while len(got) < n:
                try:
                    got.append(q.get(timeout=1.0))
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                        got += _drain(q)  # what an ended rank put just before it ended
                        assert len(got) >= n, (f"{n - len(got)} of {n} ranks ended without their result (exit "
                                               f"codes by rank: {[p.exitcode for p in procs]}); the others': {got}")
            grace = 30.0  # every rank has its result: let each leave the group
            return got
        finally:
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():
                    p.kill()


def _drain(q) -> list:
    import queue
    out = []
    try:
        while True:
            out.append(q.get(timeout=1.0))
    except queue.Empty:
        return out


def _rank(fn, rank: int, world: int, store_path: str, q, timeout_s: float, args: tuple) -> None:
    """A spawned rank: wait until every rank has started, join the process group, run fn, leave."""
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    store.set_timeout(datetime.timedelta(seconds=STARTUP_S))
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(world)])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, q, *args)
    finally:
        dist.destroy_process_group()


def interrupt(nproc: int, overrides: list[str], run_dir: Path, at_step: int, act, timeout: float,
              env: dict | None = None):
    """Start a job of `nproc` ranks (`env`: added to the workers' environment), call act(agent process)
    once it reaches `at_step`, wait for every process to end. Returns (log, seconds from act to the end,
    torchrun's exit code)."""
    import time
    log = run_dir / "first.log"
    proc = start_torchrun(nproc, overrides, run_dir, log, env)
    try:
        wait_for(lambda: progress_step(run_dir) >= at_step, 120, f"training to reach step {at_step}")
        t0 = time.monotonic()
        act(proc)
        proc.wait(timeout=timeout)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text(), took, proc.returncode


def assert_capture_matches_alone(target, ref_model, seqs, cu, pos, layer_ids, hidden: int):
    """A target's packed capture equals each sequence run alone through the transformers model: features
    of `layer_ids` (hidden_states[i + 1]) and logits. Returns (features, logits) of the packed batch."""
    import torch
    ids = torch.cat(seqs)
    feats, logits = target.capture(ids, cu, pos, layer_ids, need_logits=True)
    assert feats.shape == (ids.numel(), len(layer_ids) * hidden)
    with torch.no_grad():
        for s, seq in enumerate(seqs):
            out = ref_model(input_ids=seq[None], output_hidden_states=True)
            a, b = int(cu[s]), int(cu[s + 1])
            for j, layer in enumerate(layer_ids):
                torch.testing.assert_close(feats[a:b, j * hidden:(j + 1) * hidden], out.hidden_states[layer + 1][0],
                                           atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[a:b], out.logits[0], atol=1e-5, rtol=1e-5)
    return feats, logits


@contextlib.contextmanager
def read_only(path):
    """`path` cannot be written while inside. root ignores permission bits: the directory is made immutable
    instead (ext4/xfs; what `chattr +i` does, by its ioctl, in this process)."""
    root = os.geteuid() == 0
    if root:
        _set_immutable(path, True)
    else:
        os.chmod(path, 0o555)
    try:
        yield
    finally:
        if root:
            _set_immutable(path, False)
        else:
            os.chmod(path, 0o755)


def _set_immutable(path, on: bool) -> None:
    """FS_IOC_SETFLAGS with FS_IMMUTABLE_FL set or cleared (linux/fs.h), as e2fsprogs' chattr does."""
    import array
    import fcntl
    get_flags, set_flags, immutable = 0x80086601, 0x40086602, 0x10
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, get_flags, flags, True)
        flags[0] = flags[0] | immutable if on else flags[0] & ~immutable
        fcntl.ioctl(fd, set_flags, flags)
    finally:
        os.close(fd)


def tiny_spec(**overrides):
    """The tests' tiny drafter: vocabulary 48, hidden 32, 2 layers of 4 query and 2 key/value heads of 8,
    blocks of 4, the last id as the mask token, features of target layers 0 and 1 of 3. `overrides` are
    DraftSpec fields, or the variant's `Model` options by name (DSpark's markov_rank=6); the mask token
    follows a vocabulary given."""
    import dataclasses

    from dflash_dist.models.drafter import DraftSpec
    from dflash_dist.models.variants import variant_of
    names = {f.name for f in dataclasses.fields(DraftSpec)}
    options = {k: overrides.pop(k) for k in list(overrides) if k not in names}
    shape = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, rope_theta=10000.0, rms_eps=1e-6, block_size=4, target_layer_ids=(0, 1),
                 num_target_layers=3) | overrides
    model = variant_of(shape.get("variant", "dflash")).Model(**options)
    return DraftSpec(**{"mask_token_id": shape["vocab_size"] - 1, **shape, "options": model})


# SmolLM2-135M-Instruct's shape (its config.json on the Hub): hidden 576, 30 layers, 9 heads of 64, 3 KV heads.
SMOL = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "tie_word_embeddings": True, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}


def smol_shape(tmp_path) -> list[str]:
    """Overrides for a transformers target of SMOL's shape: its config.json alone, in tmp_path/smol."""
    (tmp_path / "smol").mkdir(exist_ok=True)
    (tmp_path / "smol" / "config.json").write_text(json.dumps(SMOL))
    return ["model.target.kind=hf", f"model.target.path={tmp_path / 'smol'}"]


def config_of(**keys):
    """A `Config` of these keys by name: `objective`'s, the others the variant's options (its `variant`
    section: Domino's lambda_fraction=0.5), as the tests' direct step calls build one."""
    import dataclasses

    from dflash_dist.config import Config, ObjectiveConfig
    names = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    options = {k: keys.pop(k) for k in list(keys) if k not in names}
    return Config(objective=ObjectiveConfig(**keys), variant=options)


def settings_of(model, *, batch_mean=True, dpace_alpha=None, **objective):
    """The `StepSettings` `step_settings` builds (as every caller does) from a config of these keys:
    `objective`'s (`batch_mean` is `loss_norm=batch`, `dpace_alpha` D-PACE's), the others the variant's
    options (the config's `variant` section: Domino's lambda_fraction=0.5)."""
    from dflash_dist.training.step import step_settings
    dpace = {} if dpace_alpha is None else {"position_weights": "dpace", "dpace_alpha": dpace_alpha}
    return step_settings(config_of(block_size=model.spec.block_size, loss_norm="batch" if batch_mean else "step",
                                   **dpace, **objective), model.spec)


def train_step(model, data, feats, target, anchors, anchor_cu, *, scale=1.0, sharding=None, **objective):
    """`training.step.drafter_step` of a batch, with the settings of `settings_of(model, **objective)`."""
    from dflash_dist.training.step import StepBatch, drafter_step
    return drafter_step(model, StepBatch(data, feats, target, anchors, anchor_cu), settings_of(model, **objective),
                        scale=scale, sharding=sharding)


def flip_byte(f, at=-20):
    """Flips one byte of file f (at a negative or positive offset): same size, another bit pattern."""
    data = bytearray(f.read_bytes())
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))


def wandb_cfg(mode, timeout=20.0):
    """The wandb section of the default config at this mode and init timeout."""
    from dflash_dist.config import load_config
    return load_config(None, [f"wandb.mode={mode}", f"wandb.init_timeout_s={timeout}"]).wandb


def exit_codes(out: str) -> set[int]:
    """The workers' exit codes that torchrun's error report lists."""
    return {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)}
