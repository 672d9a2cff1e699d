"""Distillation labels between real processes: the packet's extra payload (target labels) between
two gloo processes, and the real entry point under torchrun on target labels, hard, soft and the whole
distribution (target_full)."""
import json
import math
import traceback

import pytest
import torch
from helpers import metrics, spawn, torchrun

from dflash_dist.data.collate import PackedBatch
from dflash_dist.parallel.transport import PacketSender, PendingPacket, TargetLabels

KINDS = [("data", 0), ("target_argmax", 1), ("target_soft", 3), ("data", 0)]  # mixed on one link, in order


N, S, FD = 19, 2, 12


def _packet(b, kind, width):
    g = torch.Generator().manual_seed(b)
    data = PackedBatch(torch.randint(0, 100, (N,), generator=g), torch.rand(N, generator=g) > 0.5,
                       torch.tensor([0, 7, N]))
    feats = torch.randn(N, FD, generator=g)
    target = None
    if kind != "data":
        ids = torch.randint(0, 100, (N, width), generator=g)
        target = TargetLabels(ids, torch.randn(N, width, generator=g) if kind == "target_soft" else None)
    return data, feats, target


def _worker(rank, q):
    try:
        if rank == 1:
            s = PacketSender(max_in_flight=4)
            counts = []
            for b, (kind, width) in enumerate(KINDS):
                data, feats, target = _packet(b, kind, width)
                s.send(0, 0, b, data, feats, 1.0, 0.5, target=target)
                counts.append(len(s.queues[0][-1][1]))  # tensors of the packet just sent
            s.flush()
            q.put(("sender", counts))
        else:
            for b, (kind, width) in enumerate(KINDS):
                p = PendingPacket(1, 0, b, N, S, FD, torch.float32, torch.device("cpu"),
                                  label_width=width, soft=kind == "target_soft").wait()
                data, feats, target = _packet(b, kind, width)
                assert torch.equal(p.features, feats) and torch.equal(p.batch_data.input_ids, data.input_ids)
                assert torch.equal(p.batch_data.loss_mask, data.loss_mask)
                assert torch.equal(p.batch_data.cu_seqlens, data.cu_seqlens)
                if target is None:
                    assert p.target is None
                else:
                    assert p.target.ids.dtype == torch.int64 and torch.equal(p.target.ids, target.ids)
                    if target.values is None:
                        assert p.target.values is None
                    else:
                        assert p.target.values.dtype == torch.float32 and torch.equal(p.target.values, target.values)
            q.put(("receiver", len(KINDS)))
    except Exception:
        q.put(("exception", traceback.format_exc()))


def test_packet_with_target_labels_round_trips():
    results = dict(spawn(2, _worker, timeout_s=20))
    assert "exception" not in results, results["exception"]
    assert results["receiver"] == len(KINDS)
    assert results["sender"] == [3, 3, 4, 3]  # the data path stays three tensors; soft adds the values


DOMINO = ["model.draft.variant=domino", "variant.gru_hidden_dim=32", "variant.emb_dim=16"]


@pytest.mark.slow
@pytest.mark.parametrize("labels, variant", [("target_argmax", []), ("target_soft", []), ("target_full", []),
                                             ("target_full", DOMINO)], ids=["argmax", "soft", "full", "full-domino"])
def test_three_ranks_train_on_target_labels(tmp_path, labels, variant):
    """target_full: the target ranks send their final state as one more feature block and the drafters
    train on its whole distribution (KL and L1 both weighted here), apart from them; Domino's two terms
    (its own loss, not the plain head's) distil it alike."""
    res = torchrun(3, [f"objective.labels={labels}", "objective.soft_top_k=8", "objective.distill_l1_weight=0.5",
                       "monitor.interval_s=0.02", *variant], tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = [e["loss"] for e in summary["epochs"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert_learns(tmp_path, losses)
    assert math.isfinite(summary["final_loss"]) and summary["samples"] == 3 * (160 - sum(summary["skipped"].values()))


@pytest.mark.slow
def test_colocated_rank_trains_on_soft_labels(tmp_path):
    res = torchrun(1, ["roles.mode=colocated", "train.epochs=2", "objective.labels=target_soft",
                       "monitor.interval_s=0.02"], tmp_path)  # a progress record within the first steps
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    losses = [e["loss"] for e in json.loads((tmp_path / "summary.json").read_text())["epochs"]]
    assert all(math.isfinite(x) for x in losses), losses
    assert_learns(tmp_path, losses)


def assert_learns(run_dir, epoch_losses):
    """The loss drops in the first few steps (5-6 -> ~4.3 here), then wanders +-0.4 from batch to batch on
    these 12-batch epochs: so the last epoch's mean is compared with the first step's loss, not with the
    first epoch's mean (which holds that drop and the noise alike)."""
    steps = sorted((r["step"], r["loss"]) for r in metrics(run_dir) if r.get("kind") == "progress" and r["step"] > 0)
    assert steps, "no progress record after a step"
    assert epoch_losses[-1] < steps[0][1] - 0.25, (steps, epoch_losses)
