"""End-to-end pipeline balance: time each role computes vs waits, and achieved vs ideal throughput.

python -m dflash_dist.bench.pipeline [--nproc 3] [--json runs/bench/pipeline.json]

Two jobs on the same ranks (T targets + D drafters): one where the drafter has spare capacity (a deep
target, few anchors) and one where the drafter is the bottleneck (a shallow target, many anchors).
Ideal throughput = batches / (compute time per batch of the slowest role / its rank count): what the
pipeline would reach if the slow role never waited. The ratio achieved/ideal is the pipeline's overhead.
"""
from __future__ import annotations

import argparse

from dflash_dist.bench.jobs import check_outputs, run_job, write_json
from dflash_dist.config import ranged
from dflash_dist.observe.bars import track

COMMON = ["train.epochs=1", "data.synthetic.num_samples=1500", "monitor.interval_s=5"]
SCENARIOS = {
    "drafter has spare capacity": ["model.target.num_layers=16", "model.target.hidden_size=128",
                                   "model.target.intermediate_size=512", "model.draft.target_layer_ids=[12,13,14]",
                                   "objective.num_anchors=2"],
    "drafter is the bottleneck": ["model.target.num_layers=4", "model.draft.target_layer_ids=[0,1]",
                                  "objective.num_anchors=48", "model.draft.num_layers=2"],
}


def measure(name: str, nproc: int, extra: list[str]) -> dict:
    s = run_job(nproc, COMMON + SCENARIOS[name] + extra)
    T, D, n = s["num_targets"], s["num_drafters"], s["batches"]
    per_batch_t = s["target_compute_s"] / n  # summed over targets -> seconds of one target per batch
    per_batch_d = s["drafter_compute_s"] / n
    ideal_batches_per_s = min(T / per_batch_t, D / per_batch_d)
    achieved = n / s["time_s"]
    return {"scenario": name, "targets": T, "drafters": D, "batches": n, "tok_per_s": s["tok_per_s"],
            "wait_targets": s["wait_targets"], "wait_drafters": s["wait_drafters"],
            "target_ms_per_batch": 1e3 * per_batch_t, "drafter_ms_per_batch": 1e3 * per_batch_d,
            "slowest": "targets" if T / per_batch_t < D / per_batch_d else "drafters",
            "achieved_over_ideal": achieved / ideal_batches_per_s, "advice": s.get("balance", {})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=ranged(int, ge=2), default=3)
    ap.add_argument("--json", default="runs/bench/pipeline.json")
    ap.add_argument("overrides", nargs="*", help="extra key=value for both jobs")
    args = ap.parse_args(argv)
    check_outputs(ap, args)
    rows = [measure(name, args.nproc, args.overrides) for name in track(SCENARIOS, "pipeline: training jobs", "job",
                                                                         every_s=0)]
    print(f"{'scenario':30s} {'T:D':>5s} {'tok/s':>8s} {'tgt ms/b':>9s} {'drf ms/b':>9s} {'slowest':>9s} "
          f"{'tgt wait':>9s} {'drf wait':>9s} {'achieved/ideal':>15s}")
    for r in rows:
        print(f"{r['scenario']:30s} {r['targets']}:{r['drafters']:<3d} {r['tok_per_s']:8.0f} "
              f"{r['target_ms_per_batch']:9.1f} {r['drafter_ms_per_batch']:9.1f} {r['slowest']:>9s} "
              f"{100 * r['wait_targets']:8.1f}% {100 * r['wait_drafters']:8.1f}% {r['achieved_over_ideal']:15.2f}")
    write_json(args.json, {"nproc": args.nproc, "rows": rows})


if __name__ == "__main__":
    main()
