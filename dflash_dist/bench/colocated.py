"""Colocated (every rank runs target then drafter, DDP over all) vs disaggregated roles, same ranks.

python -m dflash_dist.bench.colocated [--nproc 3] [--json runs/bench/colocated.json] [key=value ...]
"""
from __future__ import annotations

import argparse

from dflash_dist.bench.jobs import check_outputs, run_job, write_json
from dflash_dist.config import ranged
from dflash_dist.observe.bars import track

COMMON = ["train.epochs=1", "data.synthetic.num_samples=1500", "monitor.interval_s=5"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nproc", type=ranged(int, ge=2), default=3)
    ap.add_argument("--json", default="runs/bench/colocated.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    rows = []
    for mode in track(("disaggregated", "colocated"), "colocated: training jobs", "job", every_s=0):
        s = run_job(args.nproc, COMMON + [f"roles.mode={mode}"] + args.overrides)
        rows.append({"mode": mode, "tok_per_s": s["tok_per_s"], "time_s": s["time_s"], "steps": s["steps"],
                     "final_loss": s["final_loss"], "targets": s["num_targets"], "drafters": s["num_drafters"]})
    base = rows[0]["tok_per_s"]
    print(f"{'mode':15s} {'ranks':>6s} {'T:D':>6s} {'steps':>6s} {'tok/s':>8s} {'vs disaggregated':>17s}")
    for r in rows:
        td = "all" if r["mode"] == "colocated" else f"{r['targets']}:{r['drafters']}"
        print(f"{r['mode']:15s} {args.nproc:6d} {td:>6s} {r['steps']:6d} {r['tok_per_s']:8.0f} "
              f"{r['tok_per_s'] / base:17.2f}")
    write_json(args.json, {"nproc": args.nproc, "rows": rows})


if __name__ == "__main__":
    main()
