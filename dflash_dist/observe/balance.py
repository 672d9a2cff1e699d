"""Which role is the bottleneck, and which target:drafter split the measurements suggest.

Target cost follows tokens, drafter cost follows anchors x block size, so the right split depends on
the data and the models. The cost model (dflash_dist.forecast.cost) predicts it before the run; here it is
measured, and the two are printed side by side. With per-batch compute times t_T (one target
forward, of a whole replica) and t_D (one drafter step), R target replicas and D drafters sustain
min(R / t_T, D / t_D) batches/s; on a node of L ranks, R = (L - D) / tensor_parallel. The best split
maximises that over the splits the layout accepts: parallel.topology.candidate_splits, the same search
the forecast prices, which the caller passes in because observe/ sits below parallel/.
"""
from __future__ import annotations

from typing import Sequence


def balance_advice(target_compute_s: float, drafter_compute_s: float, batches: int, ranks_per_node: int,
                   drafters_per_node: int, target_wait: float, drafter_wait: float,
                   predicted: dict | None = None, tensor_parallel: int = 1,
                   splits: Sequence[int] | None = None) -> dict:
    """target_compute_s: summed over the target replicas (their leaders report); drafter_compute_s: over the
    drafters; batches: batches trained; predicted: the cost model's seconds per batch for this run
    (`cost.predicted_per_batch`), kept beside the measured ones; splits: the drafters_per_node values to
    choose among (`topology.candidate_splits(ranks_per_node, tensor_parallel)`). Without them no split is
    suggested: guessing them here would be a second search, blind to the layout's rules."""
    if batches <= 0 or target_compute_s <= 0 or drafter_compute_s <= 0:
        return {"predicted": predicted} if predicted else {}
    t_t, t_d = target_compute_s / batches, drafter_compute_s / batches
    L, d, tp = ranks_per_node, drafters_per_node, tensor_parallel

    def sides(dn: int) -> tuple[float, float]:  # batches/s the targets, the drafters sustain at split dn
        return (L - dn) // tp / t_t, dn / t_d

    def rate(dn: int) -> float:
        return min(sides(dn))

    targets, drafters = sides(d)
    out = {
        "bottleneck": "targets" if targets < drafters else "drafters",
        "target_s_per_batch": t_t, "drafter_s_per_batch": t_d,
        "wait_targets": target_wait, "wait_drafters": drafter_wait, "current_drafters_per_node": d,
        "predicted": predicted,  # the cost model's, from shapes before the run (None: not available)
    }
    if splits:
        best = max(splits, key=rate)
        out |= {"suggested_drafters_per_node": best, "predicted_speedup": rate(best) / rate(d)}
    return out


def format_advice(a: dict) -> str:
    p = a.get("predicted") or {}
    model = (f" (cost model: target {p['target_s_per_batch'] * 1e3:.1f} ms, drafter {p['drafter_s_per_batch'] * 1e3:.1f} "
             f"ms per batch on {p['device']}; best split {p.get('best_drafters_per_node')} drafters per node)") if p else ""
    if "bottleneck" not in a:
        return "balance: not enough measurements" + model
    line = (f"balance: bottleneck {a['bottleneck']} (targets wait {100 * a['wait_targets']:.0f}%, drafters wait "
            f"{100 * a['wait_drafters']:.0f}%); per batch measured: target {a['target_s_per_batch'] * 1e3:.1f} ms, "
            f"drafter {a['drafter_s_per_batch'] * 1e3:.1f} ms" + (
                f"; predicted: target {p['target_s_per_batch'] * 1e3:.1f} ms, drafter "
                f"{p['drafter_s_per_batch'] * 1e3:.1f} ms ({p['device']}; best split {p.get('best_drafters_per_node')})"
                if p else ""))
    if "suggested_drafters_per_node" not in a:
        return line
    if a["suggested_drafters_per_node"] != a["current_drafters_per_node"]:
        line += (f"; suggest roles.drafters_per_node={a['suggested_drafters_per_node']} "
                 f"(predicted x{a['predicted_speedup']:.2f})")
    else:
        line += "; the current split is the best one for these measurements"
    return line
