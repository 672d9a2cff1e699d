"""The summary's final figures are the last epoch's means (issue 27 item 8), the tau figure draws the
measurements during training, and the memory model counts the whole target where rank 0 measures tau."""
import math

import pytest
import transformers  # noqa: F401  (the `hf` extra; `dev`, what the tests install, includes it: missing fails here)

from dflash_dist.training.state import Totals
from dflash_dist.training.stats import StepStats


def _step(loss_sum, weight, correct, valid, accept, blocks):
    import torch
    s = StepStats(3, loss_sum=loss_sum, weight_sum=weight, accept_sum=accept, blocks=blocks)
    s.correct, s.valid = torch.tensor(correct, dtype=torch.float64), torch.tensor(valid, dtype=torch.float64)
    return s


def test_the_summary_final_figures_are_the_last_epochs_means():
    from dflash_dist.observe.monitor import Progress
    from dflash_dist.roles.reporter import epoch_means, final_window
    t = Totals()
    for s in (_step(8.0, 2.0, [0, 1, 0], [0, 2, 2], 3.0, 2), _step(1.0, 1.0, [0, 2, 1], [0, 2, 2], 5.0, 2)):
        t.add(s)
        t.steps += 1
    mean = epoch_means(t)
    assert mean == {"steps": 2, "loss": 3.0, "acc": [0.75, 0.25], "accept_len": 2.0}  # pooled, not averaged
    p = Progress(num_epochs=1, epoch_counts=[2], loss=1.0, acc=[1.0, 0.5], accept_len=2.5)  # the last step
    last = final_window([{"epoch": 1, **mean}], p)
    assert last == {"window": "mean of epoch 1 (2 steps)", "loss": 3.0, "acc": [0.75, 0.25], "accept_len": 2.0}
    old = final_window([{"epoch": 1, "loss": 1.0}], p)  # a checkpoint's history of an older version
    assert old["window"] == "last step" and old["loss"] == 1.0 and math.isfinite(old["accept_len"])


def test_the_tau_figure_draws_the_measurements_during_training(tmp_path):
    from dflash_dist.report.figures import tau
    from dflash_dist.report.runs import RunData
    recs = [{"kind": "tau", "step": s, "tau": t, "_t": float(s)} for s, t in ((0, 1.0), (4, 1.4), (8, 1.9))]
    summary = {"tau_untrained": {"tau": 1.0}, "tau_trained": {"tau": 1.9}, "final_accept_len_estimate": 2.1}
    drawn = tau([RunData("run", tmp_path, recs, summary)])
    assert drawn.figure is not None
    during = drawn.figure.axes[1]
    assert during.get_title() == "tau measured during training"
    x, y = during.lines[0].get_data()
    assert list(x) == [0, 4, 8] and list(y) == [1.0, 1.4, 1.9]
    # A run still going (no summary yet) is drawn from its records alone.
    assert tau([RunData("live", tmp_path, recs, None)]).figure is not None


def test_the_memory_model_counts_the_whole_target_where_rank_0_measures_tau():
    import copy

    from dflash_dist.config import load_config
    from dflash_dist.forecast import memory as M
    from dflash_dist.forecast.shapes import model_shapes
    cfg = load_config("configs/qwen3_8b.yaml", ["data.path=/data/prepared"])
    shapes = model_shapes(cfg, "qwen3-8b")
    worst = M.BatchShape(tokens=4096, seqs=8, anchors=64)
    head_only = M.predict(cfg, shapes, worst, 141.0).roles["drafter"]
    tau_cfg = copy.deepcopy(cfg)
    tau_cfg.train.eval_bench = "heldout.jsonl"
    with_target = M.predict(tau_cfg, shapes, worst, 141.0).roles["drafter"]
    embed = shapes.vocab * shapes.hidden * (1 if shapes.tied else 2)
    assert head_only.terms["whole_target"] == 0
    assert with_target.terms["whole_target"] == (shapes.target_params - embed) * 2  # bf16, beside embed_head
    assert with_target.peak - head_only.peak == pytest.approx(with_target.terms["whole_target"])  # nothing else
    # A drafter that does not fit says that measuring tau on rank 0 is what the whole target costs.
    msg = M.preflight_message(M.predict(tau_cfg, shapes, worst, 30.0), "drafter")
    assert msg.endswith(f"or train.eval_prompts=0 (rank 0 then holds the target's head only, not its whole "
                        f"{with_target.terms['whole_target'] / 2**30:.1f} GiB, and tau is measured after the run)")
    head_msg = M.preflight_message(M.predict(cfg, shapes, worst, 20.0), "drafter")
    assert head_msg and "eval_prompts" not in head_msg


class _ShortTarget:
    """What train's start-of-run check reads of a target: a context of 16 positions."""
    kind, vocab_size, max_position_embeddings = "tiny", 128, 16


def test_an_eval_bench_prompt_longer_than_the_targets_context_is_refused_at_start(tmp_path):
    from evaluate_fixtures import write_jsonl

    from dflash_dist.config import ConfigError, load_config
    from dflash_dist.train import check_eval_bench
    bench = write_jsonl(tmp_path / "bench.jsonl", [[1, 2, 3], list(range(20)), [4, 5]])
    cfg = load_config(None, [f"data.path={tmp_path / 'prepared'}", f"train.eval_bench={bench}",
                             "train.eval_prompts=3", "train.eval_every_steps=6"])
    with pytest.raises(ConfigError, match=rf"config key 'train.eval_bench': 1 prompt\(s\) of at least the target's "
                                          rf"context of 16 positions, .*: {bench}:2 \(20 tokens\)"):
        check_eval_bench(cfg, _ShortTarget())
    cfg.train.eval_prompts = 1  # the run measures only the first prompt: nothing to refuse
    check_eval_bench(cfg, _ShortTarget())
