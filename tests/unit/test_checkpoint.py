import hashlib
import json
import logging
import re

import pytest
import torch

from dflash_dist.checkpoints import store as checkpoint
from dflash_dist.checkpoints.store import (
    begin_run,
    check_resume_data,
    cleanup_leftovers,
    completed,
    layout_meta,
    list_checkpoints,
    read_meta,
    resolve_resume,
    save_checkpoint,
)
from dflash_dist.config import ConfigError, load_config, to_dict
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.data.digest import dataset_digest
from dflash_dist.parallel.topology import Layout
from dflash_dist.plan.schedule import Cursor

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
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
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
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
        assert resolve_resume(cfg, now)[1] == Cursor(1, 5)
    assert f"on another layout ({changed}" in caplog.text
    assert "exactly in data order" in caplog.text and "not bitwise" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
        resolve_resume(cfg, ONE)
    assert "layout" not in caplog.text


def test_completed(tmp_path):
    cfg = load_config(None, [f"train.run_dir={tmp_path}", "train.epochs=2"])
    assert completed(_meta(cfg, 2, 0), cfg) and not completed(_meta(cfg, 1, 0), cfg)
    assert not completed(_meta(cfg, 1, 7), cfg)


def test_mid_epoch_resume_refuses_a_plan_that_changed(tmp_path):
    from dflash_dist.checkpoints.store import check_plan

    meta = {"cursor": {"epoch": 1, "batch": 4}, "plan_digests": ["aaa", "bbb", "ccc"]}
    check_plan(meta, tmp_path, ["aaa", "bbb", "ccc"])  # the same plans: fine
    check_plan(meta, tmp_path, ["xxx", "bbb", "yyy"])  # only the cursor's epoch is continued
    with pytest.raises(ConfigError, match=r"epoch 2 batch 4 of a plan with fingerprint bbb, but the same config and "
                                          r"data now build zzz"):
        check_plan(meta, tmp_path, ["aaa", "zzz", "ccc"])
    check_plan(dict(meta, cursor={"epoch": 1, "batch": 0}), tmp_path, ["aaa", "zzz", "ccc"])  # epoch boundary
    check_plan({"cursor": {"epoch": 1, "batch": 4}}, tmp_path, ["aaa", "zzz", "ccc"])  # saved before the check


# -- issue 19: what a resume trusts is checked; lineage across roll-backs, fresh starts and divergences -----------

def _cfg(run_dir, *more):
    return load_config(None, [f"train.run_dir={run_dir}", *more])


def _ckpt(run_dir, step, cfg, epoch=0, batch=None):
    meta = dict(_meta(cfg, epoch, step if batch is None else batch), step=step)
    return save_checkpoint(run_dir, step, {"w": torch.full((4,), float(step))}, meta)


def test_an_edited_meta_json_is_found_by_its_own_checksum(tmp_path):
    cfg = _cfg(tmp_path)
    older, newer = _ckpt(tmp_path, 10, cfg), _ckpt(tmp_path, 20, cfg)
    meta = json.loads((newer / "meta.json").read_text())
    meta["cursor"]["batch"] += 3  # 3 batches that a resume would silently skip
    (newer / "meta.json").write_text(json.dumps(meta, indent=1))
    assert "meta.json does not match its own meta_sha256" in checkpoint.checkpoint_problem(newer)
    assert resolve_resume(cfg, ONE) == (older, Cursor(0, 10))  # auto: the newest valid one
    with pytest.raises(ConfigError, match="meta_sha256"):
        resolve_resume(_cfg(tmp_path, f"train.resume={newer}"), ONE)


def _dataset(n=6, seed=0, lengths=None, mask_at=None):
    import numpy as np
    lengths = np.array(lengths or [20] * n)
    tokens = np.random.default_rng(seed).integers(0, 50, int(lengths.sum()))
    mask = np.ones(len(tokens), np.uint8)
    if mask_at is not None:
        mask[mask_at] = 0
    return TokenDataset(tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)]), loss_mask=mask,
                        vocab_size=50)


@pytest.mark.parametrize("cursor", [(0, 12), (0, 19), (1, 3), (1, -7), (2, 1), (3, 0), (-1, 0)])
def test_a_cursor_outside_the_plan_is_refused(tmp_path, cursor):
    cfg, data = _cfg(tmp_path, "train.epochs=2"), dataset_digest(_dataset())
    meta = lambda e, b: {"cursor": {"epoch": e, "batch": b}, "config": to_dict(cfg), "data": data}  # noqa: E731
    for e, b in [(0, 0), (0, 11), (1, 2), (2, 0)]:
        check_resume_data(meta(e, b), tmp_path, cfg, [12, 3], ["a", "b"], data)
    with pytest.raises(ConfigError, match=rf"cursor \(epoch {cursor[0] + 1}, batch {cursor[1]}\) lies outside the "
                                          r"plan \(2 epochs of \[12, 3\] batches\); its meta.json was edited"):
        check_resume_data(meta(*cursor), tmp_path, cfg, [12, 3], ["a", "b"], data)


@pytest.mark.parametrize("now, said", [
    (_dataset(seed=1), "the tokens changed (6 samples, as then)"),
    (_dataset(n=5), "5 samples now, 6 then"),
    (_dataset(lengths=[10, 30, 20, 20, 20, 20]), "the samples' lengths changed (6 samples, as then)"),
    (_dataset(mask_at=7), "the loss mask changed (6 samples, as then)"),
])
def test_data_changed_under_a_checkpoint_is_refused_naming_what_changed(tmp_path, now, said, caplog):
    cfg = _cfg(tmp_path)
    then = dataset_digest(_dataset())
    assert dataset_digest(_dataset()) == then  # the same data, hashed again, is the same
    for cursor in ({"epoch": 0, "batch": 2}, {"epoch": 1, "batch": 0}):  # mid-epoch, or at a boundary alike
        meta = {"cursor": cursor, "config": to_dict(cfg), "data": then}
        check_resume_data(meta, tmp_path, cfg, [4, 4, 4], ["a", "b", "c"], then)
        with pytest.raises(ConfigError, match=re.escape(f"was trained on other data: {said}, under the same data "
                                                        "config")):
            check_resume_data(meta, tmp_path, cfg, [4, 4, 4], ["a", "b", "c"], dataset_digest(now))
    # New data under a new data.path is the user's choice: allowed at an epoch boundary, and said.
    moved = _cfg(tmp_path, "data.path=/data/v2")
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
        check_resume_data({"cursor": {"epoch": 1, "batch": 0}, "config": to_dict(cfg), "data": then}, tmp_path,
                          moved, [4, 4, 4], ["a", "b", "c"], dataset_digest(now))
    assert f"on new data (data.path): {said}" in caplog.text


def test_pruning_keeps_the_newest_checkpoint_known_to_be_good(tmp_path):
    cfg = _cfg(tmp_path)
    for s in (1, 2, 3):  # each saved right after its (finite) step s: the weights of step s - 1 are vouched for
        save_checkpoint(tmp_path, s, {"s": s}, _meta(cfg, 0, s), keep_last=1, good_before=s)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    save_checkpoint(tmp_path, 4, {"s": 4}, _meta(cfg, 0, 4), keep_last=1)  # no finite step known: plain keep_last
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004"]


def _state(cfg, steps, last_finite):
    from dflash_dist.training.state import TrainState
    st = TrainState.create(torch.nn.Linear(3, 3), cfg, total_steps=10)
    st.totals.steps, st.totals.last_finite_step = steps, last_finite
    return st


def test_no_checkpoint_is_written_after_a_skipped_step(tmp_path):
    cfg = _cfg(tmp_path)
    full = {"drafter": {"w": torch.full((3,), 5e29)}}  # finite, exploded: only the skipped step says so
    assert _state(cfg, 4, 3).write(full, cfg, ONE, [12], ["a"]) is None
    assert list_checkpoints(tmp_path) == []
    assert _state(cfg, 4, 4).write(full, cfg, ONE, [12], ["a"]).name == "step-00000004"


@pytest.mark.parametrize("steps, last_finite, skipped, said", [
    (31, 30, 1, "the last step (31) was skipped"), (31, 31, 30, "30 of the run's 31 steps were skipped"),
    (31, 31, 15, None), (0, 0, 0, None)])
def test_a_run_that_ends_on_or_mostly_of_skipped_steps_diverged(tmp_path, steps, last_finite, skipped, said):
    st = _state(_cfg(tmp_path), steps, last_finite)
    st.totals.skipped_steps = skipped
    why = st.diverged_at_end()
    assert (why is None) if said is None else (said in why and why.startswith("training diverged"))


def test_a_divergence_sets_aside_what_led_only_to_nonfinite_steps(tmp_path):
    cfg = _cfg(tmp_path)
    c = {s: _ckpt(tmp_path, s, cfg) for s in (2, 4, 5, 6)}
    aside, good = checkpoint.after_divergence(tmp_path, last_finite_step=5)  # steps 6, 7, ... were skipped
    assert good == c[4]  # step 5 used its weights and was finite
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000005", "step-00000006"]
    assert aside.parent == tmp_path / "checkpoints" / "set-aside" and aside.name.startswith("diverged-")
    assert resolve_resume(cfg, ONE)[0] == c[4]  # auto: the newest known good, not the exploded ones


def test_a_lower_learning_rate_is_allowed_at_a_resume_and_applied(tmp_path, caplog):
    from dflash_dist.parallel.sharding import Replicas
    from dflash_dist.training.state import TrainState, lr_lambda
    cfg, low = _cfg(tmp_path, "optim.lr=0.5"), _cfg(tmp_path, "optim.lr=0.01", "optim.grad_clip=0.5")
    model = torch.nn.Linear(3, 3)
    st = TrainState.create(model, cfg, total_steps=10)
    for _ in range(4):
        st.optimizer.step()
        st.scheduler.step()
    saved = {"drafter": model.state_dict(), "optimizer": st.optimizer.state_dict(),
             "scheduler": st.scheduler.state_dict(), "rng": torch.get_rng_state(),
             "totals": {"steps": 4}, "history": {}}  # totals saved before last_finite_step was kept
    save_checkpoint(tmp_path, 4, {}, dict(_meta(cfg, 0, 4), step=4))
    with caplog.at_level(logging.WARNING, logger="dflash_dist.checkpoints.store"):
        assert resolve_resume(low, ONE)[1] == Cursor(0, 4)
    assert "with another optim.grad_clip and optim.lr (allowed at any resume" in caplog.text
    sharding = Replicas.__new__(Replicas)  # one process: no group to broadcast over
    sharding.model = model
    again = TrainState.create(model, low, total_steps=10)
    again.load(saved, sharding)
    factor = lr_lambda(10, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)(4)
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * factor)
    assert again.scheduler.last_epoch == 4 and again.totals.last_finite_step == 4
    again.scheduler.step()
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * lr_lambda(10, 0.05, 0.1)(5))
    with pytest.raises(ConfigError, match="optim.beta1"):  # what the optimizer state depends on: refused
        resolve_resume(_cfg(tmp_path, "optim.beta1=0.5"), ONE)


def test_after_a_roll_back_auto_and_the_same_path_continue_the_rolled_back_run(tmp_path):
    cfg = _cfg(tmp_path)
    c = {s: _ckpt(tmp_path, s, cfg) for s in (10, 20, 30)}
    back = _cfg(tmp_path, f"train.resume={c[10]}")
    assert resolve_resume(back, ONE)[0] == c[10]
    aside = begin_run(back)
    assert list_checkpoints(tmp_path) == [c[10]] and sorted(p.name for p in aside.iterdir()) == [
        "step-00000020", "step-00000030"]
    assert resolve_resume(cfg, ONE)[0] == c[10]  # a requeue with auto: not the abandoned step 30
    new = _ckpt(tmp_path, 15, cfg)  # the rolled-back run saves
    assert resolve_resume(cfg, ONE)[0] == new
    assert resolve_resume(back, ONE)[0] == new  # the same PATH again (a requeued job): the run goes on
    assert begin_run(back) is None and list_checkpoints(tmp_path) == [c[10], new]
    starts = json.loads((tmp_path / "lineage.json").read_text())["starts"]
    assert [(s["resume"], s["from"], s["step"]) for s in starts] == [(str(c[10]), str(c[10].resolve()), 10)]


def test_a_run_started_from_another_runs_checkpoint_resumes_it_until_it_has_its_own(tmp_path):
    src = _ckpt(tmp_path / "other", 40, _cfg(tmp_path / "other"))
    run = tmp_path / "run"
    cfg, start = _cfg(run), _cfg(run, f"train.resume={src}")
    old = _ckpt(run, 50, cfg)  # an earlier run in this directory
    assert resolve_resume(start, ONE)[0] == src
    assert [p.name for p in begin_run(start).iterdir()] == [old.name]
    assert resolve_resume(cfg, ONE)[0] == src  # auto before the first checkpoint of its own
    own = _ckpt(run, 45, cfg)
    assert resolve_resume(cfg, ONE)[0] == own and resolve_resume(start, ONE)[0] == own


def test_after_starting_over_auto_never_takes_the_old_runs_checkpoints(tmp_path):
    cfg = _cfg(tmp_path)
    for s in (10, 20):
        _ckpt(tmp_path, s, cfg)
    fresh = _cfg(tmp_path, "train.resume=none")
    assert resolve_resume(fresh, ONE) == (None, Cursor(0, 0))
    assert begin_run(fresh).name.startswith("started-over-")
    assert resolve_resume(cfg, ONE) == (None, Cursor(0, 0))  # the new run has no checkpoint yet
    new = _ckpt(tmp_path, 5, cfg)
    assert resolve_resume(cfg, ONE)[0] == new


def test_a_damaged_lineage_file_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "lineage.json").write_text("{\"starts\": [")
    with pytest.raises(ConfigError, match=r"lineage.json is damaged"):
        resolve_resume(_cfg(tmp_path), ONE)


def test_a_key_added_to_the_schema_after_a_checkpoint_counts_as_its_default(tmp_path):
    """A checkpoint written before a key existed has no value for it: it resumes under the key's default
    and is refused under any other value."""
    cfg = load_config(None, [f"train.run_dir={tmp_path}"])
    meta = _meta(cfg, 1, 3)
    del meta["config"]["objective"]["block_size"]  # as if block_size were added after this checkpoint
    save_checkpoint(tmp_path, 3, {}, meta)
    assert resolve_resume(cfg, ONE)[1] == Cursor(1, 3)
    with pytest.raises(ConfigError, match="objective.block_size: checkpoint 16, now 8"):
        resolve_resume(load_config(None, [f"train.run_dir={tmp_path}", "objective.block_size=8"]), ONE)
