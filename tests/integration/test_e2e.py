"""The real entry point under torchrun: 3 ranks (2 targets + 1 drafter) and 4 ranks (2 + 2)."""
import json
import re

import pytest
from helpers import epoch_lines, final_digest, metrics, torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


def check_run(res, run_dir, nproc, drafters, samples=160):
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    first = list(zip(summary["planned_batches"], summary["plan_digests"]))  # rank 0's count at start, per epoch
    assert len(first) == 3
    # Each rank's own record of the plan it trains on is its log line (made so a disagreement is visible).
    per_rank = epoch_lines(log)
    assert sorted(per_rank) == list(range(nproc)), "every rank logs every epoch's count"
    for rank, seen in per_rank.items():
        assert seen == first, f"rank {rank} saw another plan: {seen} vs {first}"
    # The monitor's epoch progress ends at exactly 100% of the count broadcast for that epoch.
    recs = metrics(run_dir)
    ends = [r for r in recs if r.get("kind") == "epoch_end"]
    assert [r["batches_per_epoch"] for r in ends] == [n for n, _ in first]
    assert all(r["batch"] == r["batches_per_epoch"] and r["epoch_progress"] == 1.0 for r in ends)
    assert ends[-1]["total_progress"] == 1.0
    # Progress lines during the run are measured against the same broadcast counts.
    for r in recs:
        if r.get("kind") == "progress":
            assert r["batches_per_epoch"] == first[r["epoch"] - 1][0]
    assert [e["batches"] for e in summary["epochs"]] == [n for n, _ in first]
    # Every sample once per epoch, but those the plan skips (counted by reason, e.g. over the budget).
    assert summary["samples"] == 3 * (samples - sum(summary["skipped"].values())), summary["skipped"]
    assert (run_dir / "export" / "model.safetensors").is_file() and (run_dir / "export" / "config.json").is_file()
    assert list((run_dir / "checkpoints").glob("step-*/drafter.pt"))
    assert summary["num_drafters"] == summary["drafter_replicas_identical"] == drafters, summary
    return log, first, summary


def test_three_ranks_two_targets_one_drafter(tmp_path):
    # Enough training for the drafter to learn the target's habits (the tiny default of the suite is not).
    # plan.token_budget=910: counts that differ across epochs here (fill packs this small corpus so
    # tightly that at 1024 every epoch has the same count).
    res = torchrun(3, ["train.eval_prompts=6", "train.eval_new_tokens=32", "objective.num_anchors=16",
                       "data.synthetic.num_samples=400", "plan.token_budget=910"], tmp_path)
    log, counts, summary = check_run(res, tmp_path, 3, 1, samples=400)
    # Real draft-then-verify decoding on held-out prompts: exact, and the trained drafter is accepted more.
    before, after = summary["tau_untrained"], summary["tau_trained"]
    assert before["exact"] and after["exact"]
    assert after["tau"] > before["tau"] + 0.1, (before, after)
    assert len({n for n, _ in counts}) > 1, f"batch counts should differ across epochs: {counts}"
    recs = [r for r in metrics(tmp_path) if r.get("kind") in ("progress", "epoch_end")]
    assert recs[-1]["loss"] < recs[0]["loss"], "the loss must fall"
    assert re.search(r"epoch 1/3  batch \d+/\d+ \(\d+%\)  total \d+%  .* tok/s  ETA .* loss .* acc@1 .* wait: targets", log)


def test_four_ranks_two_drafters_ddp_and_tail(tmp_path):
    res = torchrun(4, ["roles.drafters_per_node=2", "plan.token_budget=1120"], tmp_path)  # 12, 11, 12 batches
    log, counts, _ = check_run(res, tmp_path, 4, 2)
    odd = [n for n, _ in counts if n % 2]
    assert odd, f"want an epoch whose count is not a multiple of the drafters: {counts}"
    idle = {e["epoch"]: e["tail_idle_drafters"] for e in json.loads((tmp_path / "summary.json").read_text())["epochs"]}
    assert [idle[e + 1] for e, (n, _) in enumerate(counts)] == [n % 2 for n, _ in counts], (idle, counts)


def test_one_rank_is_a_clear_error(tmp_path):
    res = torchrun(1, [], tmp_path, timeout=60)
    assert res.returncode != 0
    assert "needs at least 2 ranks" in res.stderr + res.stdout and "roles.mode=colocated" in res.stderr + res.stdout


def test_config_error_exits_2_on_every_rank_before_any_group_forms(tmp_path):
    res = torchrun(3, ["plan.token_bugdet=10"], tmp_path, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "plan.token_bugdet" in out
    assert "exitcode  : 2" in out or "exit code 2" in out.lower() or "exitcode: 2" in out.replace(" ", "")


def test_more_drafters_than_targets(tmp_path):
    res = torchrun(4, ["roles.drafters_per_node=3", "train.epochs=1"], tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert final_digest(tmp_path) and json.loads((tmp_path / "summary.json").read_text())["num_drafters"] == 3


@pytest.mark.parametrize("override, expect, ranks_saying_it", [
    # Found once the groups formed: the vote makes every rank stop with the message.
    ("model.draft.target_layer_ids=[1,9]", "model.draft.target_layer_ids", {2}),
    ("model.draft.mask_token_id=500", "model.draft.mask_token_id", {2}),
    # Found while parsing, before any group: every rank stops alike, but torchrun ends the others as soon
    # as the first exits, so a rank still importing torch may be ended before it logs (seen in CI).
    ("roles.drafters_per_node=2", "roles.drafters_per_node", {1, 2}),
    ("objective.block_size=1", "objective.block_size", {1, 2}),
    # One target rank cannot form a replica of two.
    ("model.target.tensor_parallel=2", "model.target.tensor_parallel", {1, 2}),
])
def test_bad_input_exits_2_with_a_message_and_nobody_waits(tmp_path, override, expect, ranks_saying_it):
    import time
    t0 = time.monotonic()
    res = torchrun(2, [override], tmp_path, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and expect in out, out[-2000:]
    assert re.search(r"exitcode\s*:\s*2", out), out[-2000:]
    assert not re.search(r'File ".*dflash_dist/', out), "a clear message, not a stack trace of ours"
    # The ranks stop with the message (errors found after the groups formed name the rank at fault).
    assert len(re.findall(rf"(ERROR: |\] dflash_dist.train: ).*{re.escape(expect)}", out)) in ranks_saying_it, out[-3000:]
    assert time.monotonic() - t0 < 45


@pytest.mark.parametrize("nproc", [1, 2])
def test_colocated_mode_runs_on_one_and_two_ranks(tmp_path, nproc):
    res = torchrun(nproc, ["roles.mode=colocated", "train.epochs=1"], tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert final_digest(tmp_path) and summary["num_drafters"] == nproc  # every rank a drafter, all identical
    assert summary["samples"] == 160 - sum(summary["skipped"].values()) and summary["mode"] == "colocated"
