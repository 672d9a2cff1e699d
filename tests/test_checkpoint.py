import datetime
import hashlib
import logging
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from helpers import spawn

from dflash_dist import checkpoint
from dflash_dist.checkpoint import (Cursor, cleanup_leftovers, completed, layout_meta, list_checkpoints, read_meta,
                                    resolve_resume, save_checkpoint)
from dflash_dist.config import ConfigError, load_config, to_dict
from dflash_dist.topology import Layout

ONE = Layout(2, 2, 1)  # one drafter, one target


def _meta(cfg, epoch, batch, layout=ONE):
    return {"cursor": {"epoch": epoch, "batch": batch}, "layout": layout_meta(layout), "config": to_dict(cfg)}


class Crash(BaseException):
    """A process killed mid-save: nothing in the save may catch it."""


def test_interrupted_save_leaves_previous_checkpoint_and_auto_picks_it(tmp_path, monkeypatch):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    save_checkpoint(tmp_path, 10, {"w": torch.ones(3)}, _meta(cfg, 0, 10))

    def crash(path):  # killed after drafter.pt was written, before meta.json
        raise Crash()
    monkeypatch.setattr(checkpoint, "_fsync_file", crash)
    with pytest.raises(Crash):
        save_checkpoint(tmp_path, 20, {"w": torch.zeros(3)}, _meta(cfg, 0, 20))
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / "step-00000020.tmp" / "drafter.pt").is_file()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000010"]
    path, cursor = resolve_resume(cfg, ONE)
    assert path.name == "step-00000010" and cursor == Cursor(0, 10)
    assert torch.equal(torch.load(path / "drafter.pt")["w"], torch.ones(3))
    assert cleanup_leftovers(tmp_path) == [str(tmp_path / "checkpoints" / "step-00000020.tmp")]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000010"]


def test_keep_last_and_checksums_in_meta(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    for s in range(1, 6):
        save_checkpoint(tmp_path, s, {"s": s}, _meta(cfg, 0, s), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000005"]
    path = list_checkpoints(tmp_path)[-1]
    rec = read_meta(path)["files"]["drafter.pt"]
    data = (path / "drafter.pt").read_bytes()
    assert rec == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_resume_refuses_a_checkpoint_of_another_setup_and_lists_differences(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    save_checkpoint(tmp_path, 3, {}, _meta(cfg, 1, 3))
    changed = load_config(None, [f"train.run_dir={tmp_path}", "objective.block_size=8", "train.seed=9",
                                 "model.draft.target_layer_ids=[1,2]", "monitor.interval_s=9"])
    with pytest.raises(ConfigError) as e:
        resolve_resume(changed, ONE)
    msg = str(e.value)
    assert "objective.block_size: checkpoint 16, now 8" in msg and "model.draft.target_layer_ids" in msg
    assert "monitor.interval_s" not in msg and "train.resume=none" in msg
    # Settings that do not change training are free to differ.
    ok = load_config(None, [f"train.run_dir={tmp_path}", "monitor.interval_s=9", "wandb.mode=disabled",
                            "data.cache_dir=/elsewhere", "objective.anchor_chunk=2"])
    assert resolve_resume(ok, ONE)[1] == Cursor(1, 3)
    with pytest.raises(ConfigError, match="train.resume"):
        resolve_resume(load_config(None, [f"train.resume={tmp_path}/nope"]), ONE)


@pytest.mark.parametrize("change", ["train.seed=9", "plan.token_budget=2048", "plan.max_seqs=8",
                                    "data.synthetic.num_samples=99", "objective.num_anchors=8"])
def test_a_plan_change_is_allowed_only_at_an_epoch_boundary(tmp_path, change, caplog):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    changed = load_config(None, [f"train.run_dir={tmp_path}", change])
    save_checkpoint(tmp_path, 3, {}, _meta(cfg, 1, 3))  # mid-epoch: refused
    with pytest.raises(ConfigError, match=r"(?s)middle of epoch 2 \(batch 3\).*" + change.split("=")[0]
                       + r".*train.resume=none"):
        resolve_resume(changed, ONE)
    save_checkpoint(tmp_path, 4, {}, _meta(cfg, 2, 0))  # epoch boundary: allowed, and said
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoint"):
        assert resolve_resume(changed, ONE) == (checkpoint.checkpoint_path(tmp_path, 4), Cursor(2, 0))
    assert "at the start of epoch 3 with settings that change the plan" in caplog.text
    assert change.split("=")[0] in caplog.text


@pytest.mark.parametrize("now, changed", [
    (Layout(3, 3, 2), "num_drafters 1 -> 2, ranks_per_node 2 -> 3"),
    (Layout(4, 2, 1), "num_drafters 1 -> 2, num_targets 1 -> 2, num_nodes 1 -> 2"),
    (Layout(3, 3, 1), "num_targets 1 -> 2, ranks_per_node 2 -> 3"),
])
def test_a_layout_change_resumes_and_says_what_changed(tmp_path, now, changed, caplog):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    save_checkpoint(tmp_path, 7, {}, _meta(cfg, 1, 5))  # mid-epoch is fine: the plan does not depend on it
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoint"):
        assert resolve_resume(cfg, now)[1] == Cursor(1, 5)
    assert f"on another layout ({changed}" in caplog.text
    assert "exactly in data order" in caplog.text and "not bitwise" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoint"):
        resolve_resume(cfg, ONE)
    assert "layout" not in caplog.text


def test_completed(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.epochs=2"])
    assert completed(_meta(cfg, 2, 0), cfg) and not completed(_meta(cfg, 1, 0), cfg)
    assert not completed(_meta(cfg, 1, 7), cfg)


def _agree_worker(rank, port, q):
    from dflash_dist.dist import DistContext, agree_on_failure
    from dflash_dist.topology import Layout
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=20))
    try:
        ctx = DistContext(rank, 3, rank, Layout(3, 3, 1), "gloo", torch.device("cpu"), dist.group.WORLD, None)
        failure = ValueError("tokens.bin: token id 999 >= vocab 128 at sample 4") if rank == 2 else None
        try:
            agree_on_failure(ctx, failure)
            q.put((rank, "no error"))
        except ConfigError as exc:
            q.put((rank, str(exc)))
    except Exception:
        q.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_a_failure_on_one_rank_stops_every_rank_with_its_message():
    got = dict(spawn(3, _agree_worker))
    assert sorted(got) == [0, 1, 2]
    for msg in got.values():
        assert msg == "rank 2 (target) cannot start: tokens.bin: token id 999 >= vocab 128 at sample 4"


def test_mid_epoch_resume_refuses_a_plan_that_changed(tmp_path):
    from dflash_dist.checkpoint import check_plan

    meta = {"cursor": {"epoch": 1, "batch": 4}, "plan_digests": ["aaa", "bbb", "ccc"]}
    check_plan(meta, tmp_path, ["aaa", "bbb", "ccc"])  # the same plans: fine
    check_plan(meta, tmp_path, ["xxx", "bbb", "yyy"])  # only the cursor's epoch is continued
    with pytest.raises(ConfigError, match=r"epoch 2 batch 4 of a plan with fingerprint bbb, but the same config now "
                                          r"builds zzz"):
        check_plan(meta, tmp_path, ["aaa", "zzz", "ccc"])
    check_plan(dict(meta, cursor={"epoch": 1, "batch": 0}), tmp_path, ["aaa", "zzz", "ccc"])  # epoch boundary
    check_plan({"cursor": {"epoch": 1, "batch": 4}}, tmp_path, ["aaa", "zzz", "ccc"])  # saved before the check
