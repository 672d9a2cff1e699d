"""Nothing silent, nothing lost (issue 11): checkpoint checksums and fallback, failed and interrupted
writes, the run-directory lock, SIGINT, valid JSON, samples without an anchor, and sinks that survive a
full disk or an unreachable wandb."""
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.checkpoints.store import (CheckpointWriteError, cleanup_leftovers, layout_meta, list_checkpoints,
                                    resolve_resume, save_checkpoint)
from dflash_dist.config import ConfigError, load_config, to_dict
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.checkpoints.files import write_json
from dflash_dist.training.objective import draw_anchors
from dflash_dist.plan.epochs import check_trainable, plan_for_epoch
from dflash_dist.checkpoints.runlock import RunLock, check_writable
from helpers import read_only
from dflash_dist.parallel.stop import StopFlag
from dflash_dist.parallel.topology import Layout

ONE = Layout(2, 2, 1)


def _save(run_dir, step, w, cfg, keep_last=0):
    meta = {"cursor": {"epoch": 0, "batch": step}, "layout": layout_meta(ONE), "config": to_dict(cfg)}
    return save_checkpoint(run_dir, step, {"w": torch.full((64,), float(w))}, meta, keep_last=keep_last)


def _three(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    return cfg, [_save(tmp_path, s, s, cfg) for s in (10, 20, 30)]


# -- checkpoints: checksums, fallback, failed writes, interrupted prunes -------------------------------

def _flip_byte(f, at=-20):
    data = bytearray(f.read_bytes())
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_newest_valid_one(tmp_path, caplog):
    cfg, (c10, c20, c30) = _three(tmp_path)
    _flip_byte(c30 / "drafter.pt")  # same size, one bit pattern changed: only the checksum sees it
    with open(c20 / "drafter.pt", "r+b") as f:  # a torn copy
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
        path, cursor = resolve_resume(cfg, ONE)
    assert path == c10 and cursor.batch == 10
    assert torch.equal(torch.load(path / "drafter.pt")["w"], torch.full((64,), 10.0))
    assert f"skipping checkpoint {c30}: {c30 / 'drafter.pt'} does not match its sha256" in caplog.text
    assert f"skipping checkpoint {c20}: {c20 / 'drafter.pt'} has 100 bytes, meta.json recorded" in caplog.text
    assert f"resuming from {c10}, the newest valid checkpoint" in caplog.text


def test_an_unreadable_meta_is_skipped_and_no_valid_checkpoint_is_refused(tmp_path):
    cfg, (c10, c20, c30) = _three(tmp_path)
    (c30 / "meta.json").write_text('{"cursor": {"epo')
    assert resolve_resume(cfg, ONE)[0] == c20
    _flip_byte(c20 / "drafter.pt")
    (c10 / "drafter.pt").unlink()  # incomplete: not even listed
    with pytest.raises(ConfigError, match=r"(?s)none of the 2 checkpoints in .* can be resumed.*meta.json is "
                                          r"unreadable.*does not match its sha256.*train.resume=none"):
        resolve_resume(cfg, ONE)


def test_an_explicit_corrupt_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    cfg, (_, c20, _) = _three(tmp_path)
    _flip_byte(c20 / "drafter.pt")
    explicit = load_config(None, [f"train.run_dir={tmp_path}", f"train.resume={c20}"])
    with pytest.raises(ConfigError) as e:
        resolve_resume(explicit, ONE)
    assert f"{c20 / 'drafter.pt'} does not match its sha256" in str(e.value)
    assert "train.resume=none" in str(e.value)


def _partial_write(full_error):
    """torch.save that writes part of the file, then fails as a full disk does."""
    def save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04" + b"\0" * 1000)
        raise full_error
    return save


@pytest.mark.parametrize("error, said", [
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full"),
    # What torch 2.x raises on ENOSPC: no errno, only its writer's position check.
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 448"), "the write failed"),
    (OSError(errno.EIO, "Input/output error"), "the write failed"),
])
def test_a_failed_save_says_so_and_where_and_leaves_the_previous_checkpoints(tmp_path, monkeypatch, error, said):
    cfg, before = _three(tmp_path)
    contents = {p: (p / "drafter.pt").read_bytes() for p in before}
    monkeypatch.setattr(checkpoint.torch, "save", _partial_write(error))
    with pytest.raises(CheckpointWriteError) as e:
        _save(tmp_path, 40, 40, cfg, keep_last=2)
    msg = str(e.value)
    assert msg.startswith(f"cannot save checkpoint {tmp_path / 'checkpoints' / 'step-00000040'}: {said}")
    assert "previous checkpoints are intact and no partial one was left" in msg
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == before  # nothing pruned, nothing partial
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [p.name for p in before]
    assert all((p / "drafter.pt").read_bytes() == c for p, c in contents.items())


def test_torchs_short_write_error_on_an_almost_full_disk_is_called_a_full_disk(tmp_path, monkeypatch):
    cfg, _ = _three(tmp_path)
    monkeypatch.setattr(checkpoint.torch, "save", _partial_write(RuntimeError("unexpected pos 512 vs 448")))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(CheckpointWriteError, match=r"the disk is full \(0 MiB free there; RuntimeError"):
        _save(tmp_path, 40, 40, cfg)


class Crash(BaseException):
    """The process dies here: no except clause of the code under test catches it."""


def test_an_interrupted_prune_leaves_no_partial_checkpoint_and_leftovers_go_at_the_next_start(tmp_path, monkeypatch):
    cfg, (c10, c20, c30) = _three(tmp_path)
    real = shutil.rmtree

    def dies_while_deleting(path, *a, **k):
        if str(path).endswith(".trash") and os.path.exists(path):
            (path / "drafter.pt").unlink()  # halfway through the delete
            raise Crash()
        return real(path, *a, **k)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", dies_while_deleting)
    with pytest.raises(Crash):
        _save(tmp_path, 40, 40, cfg, keep_last=2)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000020", "step-00000030", "step-00000040"]
    assert (root / "step-00000010.trash" / "meta.json").is_file()  # the victim, never under its own name
    # Left by an older version's prune (a step directory holding only meta.json), and by a killed save.
    legacy = root / "step-00000005"
    legacy.mkdir()
    shutil.copy(c20 / "meta.json", legacy / "meta.json")
    (root / "step-00000050.tmp").mkdir()
    (tmp_path / ".summary.json.tmp-123").write_text("{")
    _flip_byte(c30 / "drafter.pt")  # damaged but complete: kept for inspection, skipped on resume
    removed = cleanup_leftovers(tmp_path)
    assert removed == [str(legacy), str(root / "step-00000010.trash"), str(root / "step-00000050.tmp"),
                       str(tmp_path / ".summary.json.tmp-123")]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030", "step-00000040"]
    assert cleanup_leftovers(tmp_path) == []


# -- the run directory: one run at a time, writable before training ------------------------------------

HOLD = """
import sys, time
from dflash_dist.checkpoints.runlock import RunLock
from dflash_dist.config import ConfigError
try:
    lock = RunLock(sys.argv[1]).acquire()
except ConfigError as e:
    print("REFUSED", e, flush=True)
    sys.exit(2)
print("HELD", flush=True)
if sys.argv[2] == "crash":
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(sys.argv[2]))
"""


def _hold(run_dir, how):
    return subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), how], stdout=subprocess.PIPE, text=True)


def test_a_second_run_on_the_same_run_dir_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path) as lock:
        assert lock.held
        other = _hold(tmp_path, "0")
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 2
        assert f"REFUSED train.run_dir {tmp_path} is in use by another run (host " in out
        assert f"pid {os.getpid()} since " in out and "choose another train.run_dir" in out
    assert not lock.held
    # Released: another process gets it, and then this one is refused.
    holder = _hold(tmp_path, "30")
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} since"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_run_is_free_at_once(tmp_path):
    crashed = _hold(tmp_path, "crash")
    assert crashed.stdout.readline().strip() == "HELD"
    assert crashed.wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / ".lock").read_text().startswith("host ")  # its record stays, the lock does not
    with RunLock(tmp_path) as lock:
        assert lock.held


def test_a_run_dir_under_a_regular_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"config key 'train.run_dir': cannot create .*/file/run: Not a directory"):
        check_writable(tmp_path / "file" / "run")


def test_a_read_only_run_dir_is_a_config_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    check_writable(ro)
    assert list(ro.iterdir()) == []  # the probe is removed
    with read_only(ro), pytest.raises(ConfigError, match=r"config key 'train.run_dir': .*/ro is not writable: "
                                                         r"(Operation not permitted|Permission denied)"):
        check_writable(ro)


@pytest.mark.parametrize("sub", ["export", "checkpoints"])
def test_a_read_only_export_or_checkpoints_directory_is_a_config_error(tmp_path, sub):
    (tmp_path / sub).mkdir()
    check_writable(tmp_path)
    with read_only(tmp_path / sub), pytest.raises(ConfigError, match=rf"config key 'train.run_dir': .*/{sub} is not "
                                                                    r"writable: (Operation not permitted|Permission denied)"):
        check_writable(tmp_path)
    assert list((tmp_path / sub).iterdir()) == []  # the probe is removed


def test_an_export_that_cannot_be_written_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch):
    """An export/ made read-only during the run (at start it is probed): exit 2 saying what to do."""
    from types import SimpleNamespace

    from dflash_dist.roles import reporter as reporting
    from dflash_dist.training.state import Totals

    def denied(spec, state, out_dir, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(out_dir / "model.safetensors"))
    monkeypatch.setattr(reporting, "export_drafter", denied)
    rep = reporting.Reporter.__new__(reporting.Reporter)  # only what export() reads
    rep.run, rep.state, rep.run_dir = SimpleNamespace(cfg=load_config(None, []), spec=None), \
        SimpleNamespace(totals=Totals()), tmp_path
    with pytest.raises(ConfigError, match=r"cannot write the export to .*/export: Permission denied; the final "
                                          r"checkpoint is saved: make the directory writable and start again with "
                                          r"train.resume=auto, which writes the export"):
        rep.export({"w": torch.zeros(2)})


# -- signals ------------------------------------------------------------------------------------------

@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_sigint_asks_for_a_stop_and_a_second_one_aborts(handlers):
    flag = StopFlag().install()
    assert flag.describe() == "stop requested by another rank"
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.requested and flag.signal_name == "SIGINT"
    assert flag.describe(now=flag.requested_at + 3.14) == "SIGINT received here 3.1 s ago"
    os.kill(os.getpid(), signal.SIGTERM)  # another kind of stop request changes nothing
    assert flag.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigterm_then_sigint_still_stops_cleanly(handlers):
    flag = StopFlag().install()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a request, already made
    assert flag.requested and flag.signal_name == "SIGTERM" and flag.describe().startswith("SIGTERM received here")


# -- valid JSON -----------------------------------------------------------------------------------------

def _strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))


def test_summary_json_is_valid_json_with_nan_as_null(tmp_path):
    f = tmp_path / "summary.json"
    f.write_text("old")
    write_json(f, {"final_loss": float("nan"), "acc": [float("inf"), 0.5, -float("inf")], "n": 3,
                   "epochs": [{"loss": np.float64("nan")}], "tau": None, "t": (1.0, float("nan"))})
    assert _strict(f.read_text()) == {"final_loss": None, "acc": [None, 0.5, None], "n": 3,
                                      "epochs": [{"loss": None}], "tau": None, "t": [1.0, None]}
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary left


# -- samples without an anchor -------------------------------------------------------------------------

def _dataset(lengths, mask_fn, vocab=64):
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    mask = np.concatenate([mask_fn(int(n)) for n in lengths]).astype(np.uint8) if len(lengths) else \
        np.zeros(0, np.uint8)
    return TokenDataset(np.zeros(offsets[-1], dtype=np.int64), offsets, mask, vocab)


def test_samples_supervised_only_at_their_first_token_are_skipped_and_nothing_to_train_is_an_error():
    ds = _dataset([12] * 40, lambda n: np.r_[1, np.zeros(n - 1)])  # no supervised token after the first
    cfg = load_config(None, ["objective.block_size=16", "train.epochs=2"])
    plans = [plan_for_epoch(ds, cfg, e) for e in range(2)]
    assert [len(p) for p in plans] == [0, 0]
    assert plans[0].skipped == {"empty": 0, "no_supervised": 0, "no_anchor": 40, "over_budget": 0}
    with pytest.raises(ConfigError) as e:
        check_trainable([len(p) for p in plans], plans[0].skipped, len(ds))
    assert str(e.value) == ("nothing to train: epoch 1 of 2 has no batch: the plan skips 40 of 40 samples: "
                            "no_anchor 40 (no supervised token after the first: check the loss mask of data.path)")
    # Twelve-token samples with a one-token prompt train at B = 16: anchors p = 0..10, blocks past the end.
    short = _dataset([12] * 40, lambda n: np.r_[0, np.ones(n - 1)])
    assert list(short.num_anchorable) == [11] * 40
    plan = plan_for_epoch(short, cfg, 0)
    assert plan.skipped["no_anchor"] == 0 and len(plan.indices) == 40


@pytest.mark.parametrize("lengths, mask, key", [
    ([], None, "the dataset has no samples (check data.path, or data.synthetic.num_samples)"),
    ([30] * 5, lambda n: np.zeros(n), "no_supervised 5 (no supervised token: check the loss mask of data.path"),
    ([3000] * 5, lambda n: np.ones(n), "over_budget 5 (longer than a batch may hold: raise plan.token_budget"),
    ([0, 0, 3000], lambda n: np.ones(n), "empty 2 (no tokens: check data.path, or data.synthetic.*); over_budget 1"),
])
def test_every_kind_of_nothing_to_train_names_its_counts_and_key(lengths, mask, key):
    ds = _dataset(lengths, mask)
    cfg = load_config(None, ["train.epochs=1"])
    plan = plan_for_epoch(ds, cfg, 0)
    with pytest.raises(ConfigError, match="nothing to train: epoch 1 of 1 has no batch") as e:
        check_trainable([len(plan)], plan.skipped, len(ds))
    assert key in str(e.value)
    check_trainable([3, 2], plan.skipped, len(ds))  # any batch: fine


def test_anchor_positions_are_the_candidates_draw_anchors_picks_from():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 60, 300)
    ds = _dataset(lengths, lambda n: rng.random(n) < 0.3)
    cu = torch.from_numpy(ds.offsets)
    mask = torch.from_numpy(ds.loss_mask.astype(bool))
    _, anchor_cu = draw_anchors(mask, cu, num_anchors=10**6, gen=torch.Generator().manual_seed(0))
    assert np.array_equal(ds.num_anchorable, np.diff(anchor_cu.numpy()))


def test_no_batch_without_an_anchor_even_one_sample_per_batch():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, 400)
    ds = _dataset(lengths, lambda n: np.r_[np.ones(n - n // 2), np.zeros(n // 2)])  # supervised heads only
    cfg = load_config(None, ["objective.block_size=16", "plan.max_seqs=1"])
    plan = plan_for_epoch(ds, cfg, 0)
    anchorable = ds.num_anchorable
    assert plan.skipped["no_anchor"] == int(np.sum(anchorable == 0)) > 0
    assert all(anchorable[plan.batch(b)].sum() > 0 for b in range(len(plan)))
    assert len(plan.indices) + sum(plan.skipped.values()) == len(ds)


# -- sinks: a full disk, wandb offline, unreachable or resumed ---------------------------------------

@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb confined to tmp_path, with no WANDB_MODE of the caller's shell."""
    for k in ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(k, str(tmp_path / "wandb-home" / k.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def _wandb_cfg(mode, timeout=20.0):
    return load_config(None, [f"wandb.mode={mode}", f"wandb.init_timeout_s={timeout}"]).wandb


def test_a_full_disk_turns_the_jsonl_sink_off_with_one_warning(tmp_path, caplog):
    from dflash_dist.observe.monitor import Sinks
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC
    sinks = Sinks(tmp_path, _wandb_cfg("disabled"), {})
    with caplog.at_level(logging.WARNING, logger="dflash_dist.observe.monitor"):
        for step in range(3):
            sinks.write({"kind": "note", "step": step}, console=False)
    sinks.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["metrics.jsonl: write failed ([Errno 28] No space left on device): JSONL metrics are off "
                        "for the rest of the run, training goes on"]
    assert sinks.jsonl is None


def test_jsonl_records_are_valid_json(tmp_path):
    from dflash_dist.observe.monitor import Sinks
    sinks = Sinks(tmp_path, _wandb_cfg("disabled"), {})
    sinks.write({"kind": "progress", "step": 1, "loss": float("nan"), "eta_s": float("inf")}, console=False)
    sinks.close()
    assert _strict((tmp_path / "metrics.jsonl").read_text()) == {"kind": "progress", "step": 1, "loss": None,
                                                                 "eta_s": None}


def test_wandb_mode_from_the_environment_overrides_the_config(tmp_path, wandb_env):
    from dflash_dist.observe.monitor import Sinks, wandb_mode
    assert wandb_mode("online") == "online"
    wandb_env.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("offline") == "disabled"
    assert Sinks(tmp_path, _wandb_cfg("offline"), {}).wandb is None
    wandb_env.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode("online") == "offline"
    wandb_env.setenv("WANDB_MODE", "bogus")
    assert wandb_mode("online") == "online"


def test_wandb_offline_resumes_the_same_run_id(tmp_path, wandb_env):
    from dflash_dist.observe.monitor import Sinks
    first = Sinks(tmp_path, _wandb_cfg("offline"), {"a": 1})
    run_id = first.run_id
    assert first.wandb is not None and first.wandb.settings.mode == "offline" and run_id
    first.write({"kind": "progress", "step": 3, "loss": 1.0}, console=False)
    first.close()
    again = Sinks(tmp_path, _wandb_cfg("offline"), {"a": 1}, run_id=run_id)
    assert again.run_id == run_id == again.wandb.id
    again.close()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r for r in runs)  # one directory per start, one id


class FakeRun:
    def __init__(self):
        self.rows, self.summary = [], {}

    def log(self, data, step):
        self.rows.append((step, data["loss"]))


def test_wandb_rows_are_never_overwritten_by_a_repeated_or_earlier_step(tmp_path):
    from dflash_dist.observe.monitor import Sinks
    sinks = Sinks(tmp_path, _wandb_cfg("disabled"), {})
    sinks.wandb = FakeRun()
    for kind, step, loss in [("progress", 4, 1.0), ("progress", 4, 2.0), ("epoch_end", 4, 3.0), ("progress", 6, 4.0),
                             ("progress", 5, 5.0), ("stopped", 6, 6.0), ("progress", 7, 7.0)]:
        sinks.write({"kind": kind, "step": step, "loss": loss}, console=False)
    sinks.write({"kind": "summary", "final_loss": 0.5}, console=False)
    assert sinks.wandb.rows == [(4, 1.0), (6, 4.0), (7, 7.0)]
    assert sinks.wandb.summary == {"epoch_end/step": 4, "epoch_end/loss": 3.0, "stopped/step": 6,
                                   "stopped/loss": 6.0, "summary/final_loss": 0.5}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8  # JSONL keeps every record
    sinks.wandb = None
    sinks.close()


def test_unreachable_wandb_online_falls_back_to_offline_within_the_timeout(tmp_path, wandb_env, caplog):
    from dflash_dist.observe.monitor import Sinks
    wandb_env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: connection refused, retried
    wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dflash_dist.observe.monitor"):
        sinks = Sinks(tmp_path, _wandb_cfg("online", timeout=2.0), {})
    took = time.monotonic() - t0
    try:
        assert sinks.wandb is not None and sinks.wandb.settings.mode == "offline"
        assert took < 2.0 + 5, took  # the bounded wait, plus an offline start on a loaded 2-core machine (was 12-13 s more)
        sync = sinks.wandb.settings.sync_dir
        assert "wandb could not start online within" in caplog.text
        assert f"logging offline to {sync} instead; upload it later with: wandb sync {sync}" in caplog.text
        sinks.write({"kind": "progress", "step": 1, "loss": 1.0}, console=False)
    finally:
        sinks.close()
    print(f"unreachable wandb online -> offline after {took:.1f} s (init_timeout_s=2)")


# -- under torchrun: found before training, exit 2; Ctrl-C saves, exit 75 --------------------------------

def _torchrun(overrides, run_dir):
    from helpers import torchrun
    res = torchrun(3, ["train.epochs=1"] + overrides, run_dir, timeout=120)
    return res.returncode, res.stdout + res.stderr


def _every_rank_says(out, text):
    return all(re.search(rf"\[rank{r} \w+\] \S+: .*{re.escape(text)}", out) for r in range(3))


@pytest.mark.slow  # whole runs under torchrun
def test_nothing_to_train_is_exit_2_on_every_rank(tmp_path):
    rc, out = _torchrun(["plan.token_budget=19"], tmp_path / "run")  # every sample has 20+ tokens
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, "cannot start: nothing to train: epoch 1 of 1 has no batch: the plan skips 160 of "
                                 "160 samples: over_budget 160"), out[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # whole runs under torchrun
def test_a_run_dir_that_cannot_be_written_is_exit_2_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    rc, out = _torchrun([], tmp_path / "file" / "run")
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, "rank 0 (drafter) cannot start: config key 'train.run_dir': cannot create"), \
        out[-3000:]
    assert "went silent" not in out and "epoch 1" not in out


@pytest.mark.slow  # whole runs under torchrun
def test_a_second_run_on_a_locked_run_dir_is_exit_2(tmp_path):
    with RunLock(tmp_path):
        rc, out = _torchrun([], tmp_path)
    assert rc != 0 and "exitcode  : 2" in out, out[-3000:]
    assert _every_rank_says(out, f"is in use by another run (host {socket.gethostname()} pid {os.getpid()}"), \
        out[-3000:]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow  # whole runs under torchrun
def test_ctrl_c_stops_on_every_rank_saves_and_exits_75(tmp_path):
    from helpers import progress_step, start_torchrun, wait_for
    log = tmp_path / "run.log"
    proc = start_torchrun(3, ["train.epochs=2", "data.synthetic.num_samples=400", "train.sync_every=2"], tmp_path,
                          log)
    try:
        wait_for(lambda: progress_step(tmp_path) >= 6, 120, "training to reach step 6")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # Ctrl-C in the terminal reaches the agent; it forwards SIGINT
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert len(re.findall(r"exit code 75: stopped on request", out)) == 3, out[-3000:]
    assert "received SIGINT: stopping at the next agreed step boundary and saving" in out
    assert "SIGINT received here" in out and "KeyboardInterrupt" not in out
    assert list_checkpoints(tmp_path), "the stop saved a checkpoint"
    print(f"SIGINT -> every process gone after {took:.1f} s")


# -- issue 19: a damaged regeneration cache file is named and made again -------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_regeneration_cache_file_is_named_and_regenerated(tmp_path, caplog, damage):
    from dflash_dist.data.dataset import TokenDataset
    from dflash_dist.data.target_corpus import cached_regenerate
    made = []

    def fn():
        made.append(1)
        tokens = np.arange(4000, dtype=np.int64) % 97
        return TokenDataset(tokens=tokens, offsets=np.array([0, 1500, 4000]), loss_mask=np.ones(4000, np.uint8),
                            vocab_size=97)
    first = cached_regenerate(tmp_path, {"k": 1}, fn)
    (f,) = tmp_path.glob("regen-*.npz")
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    else:
        _flip_byte(f, at=f.stat().st_size // 3)  # inside the tokens member: its CRC no longer matches
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.target_corpus"):
        again = cached_regenerate(tmp_path, {"k": 1}, fn)
    assert len(made) == 2 and f"cache file {f} is damaged" in caplog.text
    assert np.array_equal(again.tokens, first.tokens) and np.array_equal(again.offsets, first.offsets)
    cached_regenerate(tmp_path, {"k": 1}, fn)
    assert len(made) == 2, "the file made again is a cache hit"
