"""The receive pool of the packet transport (tests/integration/test_transport_ranks.py: the protocol between
two gloo processes)."""
import torch

from dflash_dist.parallel.transport import RecvPool


def test_recv_pool_hands_out_only_buffers_given_back():
    """The transport's CPU receive pool (bench: transport): a buffer returns only by `give_back`."""
    pool = RecvPool(max_buffers=2)
    a = pool.take(1000)
    b = pool.take(1000)
    assert a.data_ptr() != b.data_ptr()
    pa = a.data_ptr()
    c = pool.take(500)  # a is still out: never handed out again before it comes back
    assert c.data_ptr() not in (pa, b.data_ptr())
    pool.give_back(a[10:20].view(torch.int16))  # a view gives back the whole buffer behind it
    reused = pool.take(400)
    assert reused.data_ptr() == pa and pool.idle == []  # the smallest idle buffer that fits, taken out
    pool.give_back(reused)
    big = pool.take(5000)  # nothing idle is large enough: the largest idle one is dropped, not kept
    assert big.numel() == 5000 and pool.idle == []


def test_recv_pool_keeps_at_most_max_buffers():
    pool = RecvPool(max_buffers=2)
    out = [pool.take(100 * (i + 1)) for i in range(3)]
    for t in out:
        pool.give_back(t)
    assert [b.numel() for b in pool.idle] == [100, 200]
    assert pool.take(150).numel() == 150 and [b.numel() for b in pool.idle] == [100]
