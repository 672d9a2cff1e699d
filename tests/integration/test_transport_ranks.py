"""The packet protocol between two real gloo processes: packets arrive intact and in order, and a
header mismatch is a clear error."""
import traceback

import torch
from helpers import spawn

from dflash_dist.data.collate import PackedBatch
from dflash_dist.parallel.transport import PacketError, PacketSender, PendingPacket


def _worker(rank, q, sent_batch_ids):
    try:
        if rank == 1:
            s = PacketSender(max_in_flight=2)
            for b in sent_batch_ids:
                data, feats = _batch(b)
                s.send(0, 0, b, data, feats, 1.5, 0.25)
            s.flush()
            q.put(("ok", None))
        else:
            got = []
            for b in range(len(sent_batch_ids)):
                pend = PendingPacket(1, 0, b, 19, 2, 12, torch.float32, torch.device("cpu"))
                try:
                    p = pend.wait()
                except PacketError as exc:
                    q.put(("error", str(exc)))
                    return
                data, feats = _batch(b)
                assert torch.equal(p.features, feats) and torch.equal(p.batch_data.input_ids, data.input_ids)
                assert torch.equal(p.batch_data.loss_mask, data.loss_mask)
                assert torch.equal(p.batch_data.cu_seqlens, data.cu_seqlens)
                assert abs(p.sender_compute_s - 1.5) < 1e-6 and abs(p.sender_wait_s - 0.25) < 1e-6
                got.append(b)
            q.put(("ok", got))
    except Exception:
        q.put(("exception", traceback.format_exc()))
    # The receiver may have stopped early (mismatch): no barrier here, spawn's rank only leaves the group.


def _run(sent):
    return spawn(2, _worker, sent, timeout_s=20)


def test_packets_arrive_intact_in_order():
    results = _run([0, 1, 2, 3])
    assert ("ok", [0, 1, 2, 3]) in results and ("ok", None) in results


def test_header_mismatch_is_a_clear_error():
    results = _run([0, 2, 1, 3])  # the target sends batch 2 where the plan says batch 1
    errors = [msg for kind, msg in results if kind == "error"]
    assert errors, results
    assert "target rank 1" in errors[0] and "batch: expected 1, got 2" in errors[0]


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 7, 19])
    return PackedBatch(torch.randint(0, 100, (19,), generator=g), torch.rand(19, generator=g) > 0.5, cu), \
        torch.randn(19, 12, generator=g)
