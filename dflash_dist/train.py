"""Entry point: torchrun --nproc_per_node=N -m dflash_dist.train [--config FILE] [key=value ...]

config -> layout -> process groups -> build (target, data, resume point; a failure on any rank stops
every rank with that rank's message) -> role -> teardown. Exit codes: 0 done, 2 bad config or input,
75 stopped on request with state saved (requeue and resume), 3 a peer died, 1 any other failure.
"""
from __future__ import annotations

import argparse
import logging
import sys

import numpy as np
import torch
import torch.distributed as dist

from dflash_dist.checkpoint import resolve_resume
from dflash_dist.config import Config, ConfigError, load_config
from dflash_dist.data.dataset import preparation_skips
from dflash_dist.data.synthetic import synthetic_dataset
from dflash_dist.dist import DistContext, agree_on_failure, env_ranks, init_distributed, setup_logging, teardown
from dflash_dist.liveness import DONE, FAILED, Liveness
from dflash_dist.models.build import build_target, draft_spec
from dflash_dist.plan import build_plan, plan_kwargs
from dflash_dist.roles.common import RoleResult, RunSetup
from dflash_dist.stop import EXIT_RESUME, StopFlag
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


def build(cfg: Config, ctx: DistContext, stop_flag: StopFlag) -> RunSetup:
    """Everything that can fail on bad input, on every rank, before any rank waits on another."""
    try:
        target = build_target(cfg, ctx.device)
        spec = draft_spec(cfg, target)
        ds = open_dataset(cfg)
        if ds.vocab_size > spec.vocab_size:
            raise ConfigError(f"dataset vocabulary {ds.vocab_size} exceeds the target's {spec.vocab_size}")
        resume_from, cursor = resolve_resume(cfg, ctx.layout.num_drafters)
        failure = None
    except (ConfigError, ValueError, OSError) as exc:
        failure = exc
    agree_on_failure(ctx, failure)  # raises ConfigError naming the first failing rank on every rank

    counts = torch.zeros(cfg.train.epochs, dtype=torch.int64)
    if ctx.rank == 0:
        counts[:] = torch.tensor(count_epochs(cfg, ds))
        skipped = build_plan(ds.lengths, ds.num_supervised, epoch=0, **plan_kwargs(cfg)).skipped
        log.info("dataset: %d samples, %d tokens; skipped by the plan (counted, never truncated): %s%s", len(ds),
                 int(np.sum(ds.lengths)), skipped, f"; skipped when prepared: {prep}" if (prep := preparation_skips(ds)) else "")
        lay = ctx.layout
        log.info("layout: %d nodes x %d ranks, %d drafters %s, %d targets %s, backend %s", lay.num_nodes,
                 lay.local_world_size, lay.num_drafters, lay.drafter_ranks(), lay.num_targets, lay.target_ranks(),
                 ctx.backend)
    dist.broadcast(counts, src=0, group=ctx.ctrl_group)
    return RunSetup(cfg=cfg, ctx=ctx, target=target, spec=spec, dataset=ds, epoch_counts=tuple(counts.tolist()),
                    cursor=cursor, resume_from=resume_from, stop_flag=stop_flag)


def is_comm_error(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
                m in str(exc) for m in ("Connection closed", "Connection reset", "gloo", "NCCL", "imed out"))):
            return True
        exc = exc.__cause__
    return False


def run_role(setup: RunSetup) -> RoleResult:
    if setup.ctx.is_drafter:
        from dflash_dist.roles.drafter import Drafter
        return Drafter(setup).train()
    from dflash_dist.roles.target import run_target
    return run_target(setup)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        rank, world, _, local_world = env_ranks()
        colocated = cfg.roles.mode == "colocated"
        if world < 2 and not colocated:
            raise ConfigError("dflash_dist.train needs at least 2 ranks (a target and a drafter): run "
                              "torchrun --nproc_per_node=N with N >= 2, or roles.mode=colocated for one process")
        layout = Layout(world, local_world, cfg.roles.drafters_per_node, colocated=colocated)
    except (ConfigError, TopologyError, RuntimeError) as exc:
        # Every rank parses the same config, so every rank stops here alike, before any group forms.
        logging.basicConfig(format="%(levelname)s: %(message)s")
        logging.getLogger("dflash_dist").error("%s", exc)
        return 2
    setup_logging(rank, layout.role(rank))
    stop_flag = StopFlag().install()
    liveness = None
    try:
        ctx = init_distributed(cfg.dist.backend, cfg.dist.timeout_s, layout)
        liveness = Liveness(rank, world, layout.role, cfg.dist.heartbeat_s, cfg.dist.dead_after_s)
        setup = build(cfg, ctx, stop_flag)  # its collectives follow every rank's first heartbeat
        liveness.start()
        result = run_role(setup)
        liveness.mark(DONE)
        if result.stopped:
            log.warning("exit code %d: stopped on request with state saved; requeue to resume from epoch %d "
                        "step %d", EXIT_RESUME, result.cursor.epoch + 1, result.cursor.step)
            return EXIT_RESUME
        return 0
    except ConfigError as exc:
        log.error("%s", exc)
        if liveness is not None:
            liveness.mark(DONE)  # every rank stops on the same agreed error: nobody is left waiting
        return 2
    except BaseException as exc:
        if liveness is not None and is_comm_error(exc):
            # A peer probably died: give the watchdog the time to name it (it exits this process then).
            log.error("communication failed: %s; waiting up to %.0fs for the watchdog to name the silent peer",
                      exc, cfg.dist.dead_after_s)
            liveness.await_verdict(cfg.dist.dead_after_s + 2 * cfg.dist.heartbeat_s)
        log.exception("failed")
        if liveness is not None:
            liveness.mark(f"{FAILED}{type(exc).__name__}: {exc}")
        return 1
    finally:
        if liveness is not None:
            liveness.stop()
        teardown()


if __name__ == "__main__":
    sys.exit(main())
