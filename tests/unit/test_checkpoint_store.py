"""Checkpoint files (checkpoints.store): checksums and the fallback to the newest valid checkpoint, failed
and interrupted writes, interrupted prunes."""
import errno
import logging
import os
import shutil

import pytest
import torch
from helpers import flip_byte

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.checkpoints.store import (
    CheckpointWriteError,
    cleanup_leftovers,
    layout_meta,
    list_checkpoints,
    resolve_resume,
    save_checkpoint,
)
from dflash_dist.config import ConfigError, load_config, to_dict
from dflash_dist.parallel.topology import Layout

ONE = Layout(2, 2, 1)


def _save(run_dir, step, w, cfg, keep_last=0):
    meta = {"cursor": {"epoch": 0, "batch": step}, "layout": layout_meta(ONE), "config": to_dict(cfg)}
    return save_checkpoint(run_dir, step, {"w": torch.full((64,), float(w))}, meta, keep_last=keep_last)


def _three(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    return cfg, [_save(tmp_path, s, s, cfg) for s in (10, 20, 30)]


# -- checkpoints: checksums, fallback, failed writes, interrupted prunes -------------------------------


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_newest_valid_one(tmp_path, caplog):
    cfg, (c10, c20, c30) = _three(tmp_path)
    flip_byte(c30 / "drafter.pt")  # same size, one bit pattern changed: only the checksum sees it
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
    flip_byte(c20 / "drafter.pt")
    (c10 / "drafter.pt").unlink()  # incomplete: not even listed
    with pytest.raises(ConfigError, match=r"(?s)none of the 2 checkpoints in .* can be resumed.*meta.json is "
                                          r"unreadable.*does not match its sha256.*train.resume=none"):
        resolve_resume(cfg, ONE)


def test_an_explicit_corrupt_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    cfg, (_, c20, _) = _three(tmp_path)
    flip_byte(c20 / "drafter.pt")
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
    flip_byte(c30 / "drafter.pt")  # damaged but complete: kept for inspection, skipped on resume
    removed = cleanup_leftovers(tmp_path)
    assert removed == [str(legacy), str(root / "step-00000010.trash"), str(root / "step-00000050.tmp"),
                       str(tmp_path / ".summary.json.tmp-123")]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020", "step-00000030", "step-00000040"]
    assert cleanup_leftovers(tmp_path) == []


# -- the run directory: one run at a time, writable before training ------------------------------------


# -- signals ------------------------------------------------------------------------------------------


# -- valid JSON -----------------------------------------------------------------------------------------


# -- samples without an anchor -------------------------------------------------------------------------


# -- sinks: a full disk, wandb offline, unreachable or resumed ---------------------------------------


# -- under torchrun: found before training, exit 2; Ctrl-C saves, exit 75 --------------------------------


# -- issue 19: a damaged regeneration cache file is named and made again -------------------------------------------

