"""Entry point: torchrun --nproc_per_node=N -m dflash_dist.train [--config FILE] [key=value ...]

config -> layout -> models and data (before any process group, so bad input fails fast on every
rank alike) -> process groups -> role -> teardown.
"""
from __future__ import annotations

import argparse
import logging
import sys

import numpy as np
import torch
import torch.distributed as dist

from dflash_dist.config import Config, ConfigError, load_config
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.dist import env_ranks, init_distributed, setup_logging, teardown, choose_backend
from dflash_dist.models.build import build_target, draft_spec
from dflash_dist.plan import build_plan, plan_kwargs
from dflash_dist.roles.common import RunSetup
from dflash_dist.topology import Layout, TopologyError

log = logging.getLogger("dflash_dist.train")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="dflash_dist.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file overriding the schema defaults")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. plan.token_budget=4096")
    return ap.parse_args(argv)


def open_dataset(cfg: Config):
    if cfg.data.path:
        from dflash_dist.data.disk import open_dataset as open_disk  # the prepared on-disk format
        return open_disk(cfg.data.path)
    return synthetic_dataset(cfg.data.synthetic, cfg.model.target.vocab_size)


def count_epochs(cfg: Config, ds) -> list[int]:
    """Rank 0 counts every epoch's batches at start: the LR horizon and the ETA use this exact total."""
    lengths, sup = ds.lengths, ds.num_supervised
    return [len(build_plan(lengths, sup, epoch=e, **plan_kwargs(cfg))) for e in range(cfg.train.epochs)]


def run(cfg: Config, layout: Layout) -> dict:
    rank, _, local_rank, _ = env_ranks()
    backend = choose_backend(cfg.dist.backend)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    target = build_target(cfg, device)
    spec = draft_spec(cfg, target)
    ds = open_dataset(cfg)
    if ds.vocab_size > spec.vocab_size:
        raise ConfigError(f"dataset vocabulary {ds.vocab_size} exceeds the target's {spec.vocab_size}")

    ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, layout)
    counts = torch.zeros(cfg.train.epochs, dtype=torch.int64)
    if rank == 0:
        counts[:] = torch.tensor(count_epochs(cfg, ds))
    dist.broadcast(counts, src=0, group=ctx.ctrl_group)
    setup = RunSetup(cfg=cfg, ctx=ctx, target=target, spec=spec, dataset=ds, epoch_counts=tuple(counts.tolist()))
    if rank == 0:
        skipped = build_plan(ds.lengths, ds.num_supervised, epoch=0, **plan_kwargs(cfg)).skipped
        log.info("dataset: %d samples, %d tokens; skipped %s", len(ds), int(np.sum(ds.lengths)), skipped)
        log.info("layout: %d nodes x %d ranks, %d drafters %s, %d targets %s, backend %s",
                 layout.num_nodes, layout.local_world_size, layout.num_drafters, layout.drafter_ranks(),
                 layout.num_targets, layout.target_ranks(), ctx.backend)
    if ctx.is_drafter:
        from dflash_dist.roles.drafter import Drafter
        return Drafter(setup).train()
    from dflash_dist.roles.target import run_target
    return run_target(setup)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        rank, world, _, local_world = env_ranks()
        if world < 2:
            raise ConfigError("dflash_dist.train needs at least 2 ranks (a target and a drafter): run "
                              "torchrun --nproc_per_node=N with N >= 2")
        layout = Layout(world, local_world, cfg.roles.drafters_per_node)
    except (ConfigError, TopologyError, RuntimeError) as exc:
        logging.basicConfig(format="%(levelname)s: %(message)s")
        logging.getLogger("dflash_dist").error("%s", exc)
        return 2
    setup_logging(rank, layout.role(rank))
    try:
        run(cfg, layout)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    except Exception:
        log.exception("failed")
        raise
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
