import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from helpers import spawn

from dflash_dist.checkpoint import Cursor, list_checkpoints, resolve_resume, save_checkpoint
from dflash_dist.config import ConfigError, load_config, to_dict


def _meta(cfg, epoch, step, drafters=1):
    return {"cursor": {"epoch": epoch, "step": step}, "num_drafters": drafters, "config": to_dict(cfg)}


def test_interrupted_save_leaves_previous_checkpoint_and_auto_picks_it(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    save_checkpoint(tmp_path, 10, {"w": torch.ones(3)}, _meta(cfg, 0, 10))
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, 20, {"w": torch.zeros(3)}, _meta(cfg, 0, 20), _fail_after_state=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000010"]
    path, cursor = resolve_resume(cfg, num_drafters=1)
    assert path.name == "step-00000010" and cursor == Cursor(0, 10)
    assert torch.equal(torch.load(path / "drafter.pt")["w"], torch.ones(3))


def test_keep_last(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    for s in range(1, 6):
        save_checkpoint(tmp_path, s, {}, _meta(cfg, 0, s), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]


def test_resume_refuses_a_checkpoint_of_another_setup_and_lists_differences(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    save_checkpoint(tmp_path, 3, {}, _meta(cfg, 1, 3))
    changed = load_config(None, [f"train.run_dir={tmp_path}", "objective.block_size=8", "train.seed=9",
                                 "model.draft.target_layer_ids=[1,2]", "monitor.interval_s=9"])
    with pytest.raises(ConfigError) as e:
        resolve_resume(changed, num_drafters=1)
    msg = str(e.value)
    assert "objective.block_size: checkpoint 16, now 8" in msg and "train.seed" in msg
    assert "model.draft.target_layer_ids" in msg and "monitor.interval_s" not in msg
    with pytest.raises(ConfigError, match="number of drafters: checkpoint 1, now 2"):
        resolve_resume(cfg, num_drafters=2)
    # Settings that do not change training are free to differ.
    ok = load_config(None, [f"train.run_dir={tmp_path}", "monitor.interval_s=9", "wandb.mode=disabled"])
    assert resolve_resume(ok, num_drafters=1)[1] == Cursor(1, 3)
    with pytest.raises(ConfigError, match="train.resume"):
        resolve_resume(load_config(None, [f"train.resume={tmp_path}/nope"]), num_drafters=1)


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

    meta = {"cursor": {"epoch": 1, "step": 4}, "plan_digests": ["aaa", "bbb", "ccc"]}
    check_plan(meta, tmp_path, ["aaa", "bbb", "ccc"])  # the same plans: fine
    check_plan(meta, tmp_path, ["xxx", "bbb", "yyy"])  # only the cursor's epoch is continued
    with pytest.raises(ConfigError, match=r"epoch 2 step 4 of a plan with fingerprint bbb, but the same config now "
                                          r"builds zzz"):
        check_plan(meta, tmp_path, ["aaa", "zzz", "ccc"])
    check_plan(dict(meta, cursor={"epoch": 1, "step": 0}), tmp_path, ["aaa", "zzz", "ccc"])  # epoch boundary
    check_plan({"cursor": {"epoch": 1, "step": 4}}, tmp_path, ["aaa", "zzz", "ccc"])  # saved before the check
