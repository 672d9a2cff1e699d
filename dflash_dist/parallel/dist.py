"""Process groups, backend and device choice, logging with rank and role, teardown.

Groups: the default group on the data backend (NCCL with CUDA, gloo otherwise) carries feature packets
and drafter gradients; a gloo "control" group over all ranks carries the plan and other small CPU
messages; the drafter group (data backend) is DDP's. All are created once, here, and passed down in a
frozen DistContext value.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dflash_dist.parallel.topology import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    layout: Layout
    backend: str
    device: torch.device
    ctrl_group: Any  # gloo, all ranks
    drafter_group: Any  # data backend, drafters only
    replica_group: Any = None  # data backend: this target rank's replica (tensor_parallel > 1), else None

    @property
    def role(self) -> str:
        return self.layout.role(self.rank)

    @property
    def is_drafter(self) -> bool:
        """Trains the drafter (a colocated rank does both)."""
        return self.role != "target"


def env_ranks() -> tuple[int, int, int, int]:
    """(rank, world, local rank, local world) as torchrun sets them."""
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    except KeyError as exc:
        raise RuntimeError(f"environment variable {exc} is not set: launch with torchrun") from exc


class _RankFilter(logging.Filter):
    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_role = self.tag
        return True


def setup_logging(rank: int, role: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter(f"rank{rank} {role}"))
    handler.setFormatter(logging.Formatter("%(asctime)s [%(rank_role)s] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend_req: str, timeout_s: float, layout: Layout) -> DistContext:
    rank, world, local_rank, _ = env_ranks()
    backend = choose_backend(backend_req)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ranks share the cores: one intra-op thread pool each would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.local_world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    # A separate gloo group even when the data backend is gloo: plan broadcasts never queue behind packets.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    # new_group is collective: every rank creates the drafter group, drafters use it.
    drafters = dist.new_group(layout.drafter_ranks(), backend=backend, timeout=timeout)
    replica = None
    if layout.tensor_parallel > 1:  # every rank creates every replica's group, in the same order
        for ranks in layout.replica_groups():
            g = dist.new_group(ranks, backend=backend, timeout=timeout)
            replica = g if rank in ranks else replica
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, layout=layout, backend=backend,
                       device=device, ctrl_group=ctrl, drafter_group=drafters, replica_group=replica)


def teardown() -> None:
    """Safe to call on any failure path, with or without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a peer may be gone already; we are exiting anyway
            log.warning("destroy_process_group failed: %s", exc)


def agree_on_failure(ctx: DistContext, failure: BaseException | None) -> None:
    """Collective over the control group: if any rank failed its local checks, every rank raises
    ConfigError with the first failing rank's message, instead of the others timing out later."""
    from dflash_dist.config import ConfigError

    flags = torch.zeros(ctx.world_size, dtype=torch.int64)
    flags[ctx.rank] = int(failure is not None)
    dist.all_reduce(flags, group=ctx.ctrl_group)
    if not flags.any():
        return
    first = int(torch.nonzero(flags)[0])
    msg = torch.zeros(4096, dtype=torch.uint8)
    if ctx.rank == first:
        raw = str(failure).encode()[:4096]
        msg[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(msg, src=first, group=ctx.ctrl_group)
    text = bytes(msg[msg != 0].tolist()).decode(errors="replace")
    raise ConfigError(f"rank {first} ({ctx.layout.role(first)}) cannot start: {text}")
