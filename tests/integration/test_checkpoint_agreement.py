"""Checkpoint agreement between real gloo processes: a failure on one rank stops every rank with its
message."""
import traceback

import torch
import torch.distributed as dist
from helpers import spawn

from dflash_dist.config import ConfigError


def _agree_worker(rank, q):
    from dflash_dist.parallel.dist import DistContext, agree_on_failure
    from dflash_dist.parallel.topology import Layout
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


def test_a_failure_on_one_rank_stops_every_rank_with_its_message():
    got = dict(spawn(3, _agree_worker, timeout_s=20))
    assert sorted(got) == [0, 1, 2]
    for msg in got.values():
        assert msg == "rank 2 (target) cannot start: tokens.bin: token id 999 >= vocab 128 at sample 4"
