"""The cost model: seconds per batch of each role, predicted from shapes, and the target:drafter split
that follows.

It reads the same description of the job as the memory model (`job.BatchShape`, `job.Precision`,
`job.Sharding`, `shapes.ModelShapes`) and the same batches: those of the run's own plans
(`plan.build_plan`, anchors per sample from `plan.anchors_per_sample` over `TokenDataset.num_anchorable`
or, without a dataset, `memory.tail_anchorable`). Each role's batch is a sum of named terms; a term is an
amount of work of one kind:
  matmul            FLOPs of dense matrix products (2 per multiply-add)
  causal_attention  FLOPs of the target's attention scores and values (causal within each sequence)
  block_attention   FLOPs of the drafter's (each block over its context and itself), as its path runs
                    them (`block_pairs`: "sdpa" and "ref" also score context a block does not see)
  memory     bytes read and written by element-wise work (norms, RoPE, activations, softmax of the loss,
             AdamW, autocast's weight casts)
  link       bytes between GPUs of one node (features sent, tensor-parallel all-reduces, gradient sync)
  network    bytes between nodes (gradient sync of a multi-node job)
and takes amount / (device peak of its kind x the kind's efficiency) seconds (`Device`, `Efficiency`).

  target   its decoder layers up to the last captured one (all of them, and the LM head, for distillation
           labels): projections and MLP (or the active experts and the router), causal attention over each
           packed sequence, element-wise work; tensor parallel divides them and adds two all-reduces per
           layer; then the features sent to the drafter.
  drafter  fc over the batch (forward and weight gradient: its input needs none); per anchor chunk the
           context rows' k/v projections in every layer (`chunk_spans`, as step.py slices them), the
           draft layers over the block rows (anchors x B), block attention over each block's context and
           itself, the frozen LM head over the rows with a label (logits and their input gradient) and the
           loss's softmax; backward twice the forward for what trains; a layer recompute with
           model.draft.checkpoint_layers; AdamW and the gradient all-reduce (FSDP: gathers and a
           reduce-scatter) once per step.
Drafters step in lockstep, so a step lasts as long as its slowest drafter's batch: the drafter's time
per batch is the expected maximum over D batches of the plan (`lockstep_seconds`). The job's rate is
min(target replicas / target seconds, drafters / drafter seconds) batches per second (`rate`).

Anchor positions are not in a plan. Each anchor is placed where a sample whose supervised tokens are its
tail draws them: spread evenly over its candidates, the last `anchorable` positions before its final
token (`expected_anchor_pos`); a multi-turn sample's anchors sit earlier, which only shortens their
context (attention is ~10% of a drafter step at the reference shape). The efficiencies are assumptions
until measured: `python -m dflash_dist.bench.gpu_check` compares each role's predicted seconds with its
measured seconds on the GPU, and `bench.cost --validate` the drafter:target ratio on CPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from dflash_dist.config import Config
from dflash_dist.data.anchors import anchors_per_sample
from dflash_dist.forecast.job import BatchShape, Precision, Sharding
from dflash_dist.forecast.memory import SDPA_GROUP, feature_blocks, runs_whole_target
from dflash_dist.forecast.shapes import ModelShapes
from dflash_dist.forecast.variants import draft_param_count, forecast_of
from dflash_dist.forecast.work import DEVICES, Device, Efficiency, RoleCost, Term
from dflash_dist.parallel.topology import candidate_splits  # the one split search (C.candidate_splits for callers)
from dflash_dist.parallel.transport import target_label_width

log = logging.getLogger(__name__)

# Bytes per logit of the loss's element-wise work (objective._head_chunk): the matmul output in the compute
# dtype, its float32 copy, max, subtract and exp in place, the sum, the gradient's scaling, its cast back.
LOSS_BYTES_F32 = 36
ADAMW_BYTES = 28  # per parameter (fp32): read param, grad, exp_avg, exp_avg_sq; write param and both moments
LOCKSTEP_DRAWS = 2000  # Monte Carlo draws of a step's D batches


# -- batches ------------------------------------------------------------------------------------------

def expected_anchor_pos(lengths: np.ndarray, anchorable: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """Offsets in their sequences of `anchors[i]` anchors per sequence, spread evenly over the sequence's
    candidates, its last `anchorable[i]` positions before its final token (a tail-supervised sample)."""
    lengths, anchorable, anchors = (np.asarray(x, dtype=np.int64) for x in (lengths, anchorable, anchors))
    seq = np.repeat(np.arange(len(anchors)), anchors)
    rank = np.arange(int(anchors.sum())) - np.repeat(np.cumsum(anchors) - anchors, anchors)
    span = np.maximum(anchorable, anchors)[seq]
    lo = lengths[seq] - 1 - span
    return np.clip(lo + ((rank + 0.5) * span / np.maximum(anchors[seq], 1)).astype(np.int64), 0, None)


def plan_shape(plan, b: int, lengths: np.ndarray, anchorable: np.ndarray, num_anchors: int) -> BatchShape:
    """Batch `b` of `plan` as the memory model describes a batch, with expected anchor positions."""
    idx = plan.batch(b)
    lens, cand = np.asarray(lengths)[idx], np.asarray(anchorable)[idx]
    anch = anchors_per_sample(cand, num_anchors)
    return BatchShape(tokens=int(lens.sum()), seqs=len(idx), anchors=int(anch.sum()),
                      seq_lens=tuple(int(x) for x in lens), seq_anchors=tuple(int(x) for x in anch),
                      anchor_pos=tuple(int(x) for x in expected_anchor_pos(lens, cand, anch)))


def _anchor_arrays(w: BatchShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed position of each anchor, its sequence's start, its sequence's length). Without anchor
    positions, each sequence's anchors are its last ones before the final token."""
    lens = np.asarray(w.seq_lens or (w.tokens,), dtype=np.int64)
    anch = np.asarray(w.seq_anchors or (w.anchors,), dtype=np.int64)
    pos = np.asarray(w.anchor_pos, dtype=np.int64) if w.anchor_pos else expected_anchor_pos(lens, anch, anch)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.repeat(starts, anch) + pos, np.repeat(starts, anch), np.repeat(lens, anch)


def chunk_spans(w: BatchShape, chunk: int) -> np.ndarray:
    """Context rows each anchor chunk projects (step.drafter_step): from its first anchor's sequence start
    to its last anchor (at least one row)."""
    packed, starts, _ = _anchor_arrays(w)
    A = len(packed)
    size = chunk if 0 < chunk < A else A
    first = np.arange(0, A, size)
    last = np.minimum(first + size, A) - 1
    return np.maximum(packed[last], starts[first] + 1) - starts[first]


def block_pairs(w: BatchShape, chunk: int, block_size: int, path: str) -> float:
    """(query, key) pairs the drafter's attention path scores for `w` per layer. "flex" (tiles aside):
    each block against its context and itself. "sdpa": one call per run of at most SDPA_GROUP blocks of
    one sequence within an anchor chunk, its queries against the context up to the run's last anchor
    and all of the run's blocks. "ref": one run per sequence and chunk, each block against that context
    and itself."""
    packed, starts, _ = _anchor_arrays(w)
    A, B = len(packed), block_size
    ctx = packed - starts
    if path == "flex" or not A:
        return float(B * (ctx + B).sum())
    group = SDPA_GROUP if path == "sdpa" else A
    size = chunk if 0 < chunk < A else A
    idx = np.arange(A)
    new = np.ones(A, dtype=bool)  # a new (chunk, sequence) segment starts here
    new[1:] = (idx[1:] % size == 0) | (starts[1:] != starts[:-1])
    seg_start = np.maximum.accumulate(np.where(new, idx, 0))
    run = np.cumsum(new | ((idx - seg_start) % group == 0)) - 1
    last = np.flatnonzero(np.r_[run[1:] != run[:-1], True])  # the last anchor of every run
    blocks = np.diff(np.r_[-1, last])
    own = blocks * B if path == "sdpa" else B
    return float((blocks * B * (ctx[last] + own)).sum())


# -- the two roles ------------------------------------------------------------------------------------

def _target_layer_macs(s: ModelShapes, sparse: bool) -> float:
    """Multiply-adds per token of one target layer's matmuls (a sparse layer: router and active experts)."""
    H, Q, K = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    attn = H * (Q + 2 * K) + Q * H
    if sparse:
        return attn + s.experts * H + s.experts_per_token * 3 * H * s.moe_intermediate
    return attn + 3 * H * s.intermediate


def target_forward_flops(s: ModelShapes, seq_lens, last: int) -> tuple[float, float]:
    """(matmul FLOPs, causal attention FLOPs) of the target's first `last` layers over sequences of these
    lengths: 2 per multiply-add of the layers' weights per token; scores and values, 2 matmuls of 2 FLOPs
    per multiply-add over l(l+1)/2 (query, key) pairs per sequence and head. The forecast and the GPU
    check's MFU both count with this."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    sparse = sum(1 for i in s.sparse_layers if i < last)
    macs = (last - sparse) * _target_layer_macs(s, False) + sparse * _target_layer_macs(s, True)
    pairs = float((lens * (lens + 1) / 2).sum())
    return 2 * float(lens.sum()) * macs, 4 * s.heads * s.head_dim * pairs * last


def _target_layer_bytes(s: ModelShapes, sparse: bool, c: int, tp: int) -> float:
    """Element-wise bytes per token of one target layer: two norms, two residual adds, RoPE over q and k,
    silu(gate) * up (a sparse layer: its experts' and the gather/scatter of its k copies of the token)."""
    Q, K = s.heads * s.head_dim, s.kv_heads * s.head_dim
    mlp = s.experts_per_token * (5 * s.moe_intermediate + 4 * s.hidden) if sparse else 5 * s.intermediate
    return c * (10 * s.hidden + (4 * (Q + K) + mlp) / tp)


def target_terms(s: ModelShapes, p: Precision, cfg: Config, w: BatchShape, sharding: Sharding = Sharding()) -> RoleCost:
    """One target replica's work on batch `w`, per rank of the replica (tensor parallel divides it)."""
    tp, c, N = max(1, sharding.tensor_parallel), p.target_bytes, w.tokens
    width = target_label_width(cfg.objective.labels, cfg.objective.soft_top_k)
    distill = width > 0  # the target's own logits (target_full's distribution is the drafter's: below)
    last = s.layers if runs_whole_target(cfg) else max(s.feature_layers) + 1  # else capture stops after the last captured layer
    sparse = sum(1 for i in s.sparse_layers if i < last)
    elem = (last - sparse) * _target_layer_bytes(s, False, c, tp) + sparse * _target_layer_bytes(s, True, c, tp)
    matmul, attention = target_forward_flops(s, w.seq_lens or (N,), last)
    t = {
        "layers": Term("matmul", matmul / tp),
        "attention": Term("causal_attention", attention / tp),
        "elementwise": Term("memory", N * elem),
        "send": Term("link", N * (feature_blocks(s, cfg) * s.hidden * p.transfer_bytes + 8 * width)),
    }
    if distill:
        t["lm_head"] = Term("matmul", 2 * N * s.hidden * s.vocab / tp)
    if tp > 1:  # two all-reduces of the layer's output per layer (ring: 2 (tp - 1) / tp of the bytes)
        t["tp_all_reduce"] = Term("link", 2 * last * N * s.hidden * c * 2 * (tp - 1) / tp)
    return RoleCost(t)


def _draft_layer_macs(s: ModelShapes) -> float:
    H, Q, K = s.hidden, s.draft_heads * s.draft_head_dim, s.draft_kv_heads * s.draft_head_dim
    return H * (Q + 2 * K) + Q * H + 3 * H * s.draft_intermediate


def drafter_terms(s: ModelShapes, p: Precision, cfg: Config, w: BatchShape, chunk: int,
                  sharding: Sharding = Sharding(), nodes: int = 1) -> RoleCost:
    """One drafter's step on batch `w` with `chunk` anchors per chunk (0 = all). Backward = 2 x forward for
    what trains; fc's input and the LM head are frozen, so each has one product in its backward."""
    H, K, B, V, L = s.hidden, s.draft_kv_heads * s.draft_head_dim, s.block_size, s.vocab, s.draft_layers
    c, N, R = p.drafter_compute, w.tokens, w.anchors * B
    packed, starts, lens = _anchor_arrays(w)
    ctx = (packed - starts).astype(np.float64)  # context rows each block sees
    spans = chunk_spans(w, chunk)
    rows = float(np.clip(lens - 1 - (packed - starts), 0, B - 1).sum())  # block rows with a label
    per_pair = 4 * s.draft_heads * s.draft_head_dim * L  # forward FLOPs per (query, key) pair, all layers
    attn_fwd = per_pair * B * float((ctx + B).sum())
    attn_run = per_pair * block_pairs(w, chunk, B, p.attention)
    kv_fwd = 2 * float(spans.sum()) * H * 2 * K * L
    layers_fwd = 2 * R * L * _draft_layer_macs(s)
    t = {
        "fc": Term("matmul", 2 * 2 * N * len(s.feature_layers) * H * H),
        "context_kv": Term("matmul", 3 * kv_fwd),
        "layers": Term("matmul", 3 * layers_fwd),
        "attention": Term("block_attention", 3 * attn_run, useful=3 * attn_fwd),
        "lm_head": Term("matmul", 2 * 2 * rows * H * V),
        "loss": Term("memory", rows * V * (LOSS_BYTES_F32 + (c + 4 if c != 4 else 0))),
        # fp32 norms and residuals, RoPE, the MLP's activations; backward twice; context rows' k/v norms
        "elementwise": Term("memory", 3 * L * (R * (40 * H + c * (4 * (H + K) + 5 * s.draft_intermediate))
                                               + float(spans.sum()) * c * 6 * K) + N * 12 * H),
    }
    own = forecast_of(cfg)
    t.update(own.cost_terms(s, cfg, c, R, rows, w.anchors))  # the variant's own modules (its Variant.forecast)
    if cfg.objective.labels == "target_full":  # objective._distill_rows: the target's logits (forward only),
        # its log-softmax and p_t, the KL and L1 passes: about as much element-wise work again as the loss's
        t["distill_head"] = Term("matmul", 2 * rows * H * V)
        t["distill_loss"] = Term("memory", own.distill_passes(cfg) * rows * V
                                 * (LOSS_BYTES_F32 + (c + 4 if c != 4 else 0)))
    if cfg.model.draft.checkpoint_layers:
        # torch's non-reentrant checkpoint stops once the saved tensors are rebuilt: no layer's down_proj
        down = 2 * R * L * s.hidden * s.draft_intermediate
        t["recompute"] = Term("matmul", layers_fwd - down + kv_fwd, useful=0.0)
        t["recompute_attention"] = Term("block_attention", attn_run, useful=0.0)
    if p.autocast:  # each chunk's autocast region casts the weights again (fp32 read, bf16 written)
        t["weight_casts"] = Term("memory", len(spans) * (4 + c) * draft_param_count(s, cfg))
    t.update(step_terms(s, sharding, nodes, draft_param_count(s, cfg)))
    return RoleCost(t)


STEP_TERMS = ("adamw", "grad_sync")  # once per optimizer step, not per batch


def step_terms(s: ModelShapes, sharding: Sharding, nodes: int = 1, params: int | None = None) -> dict[str, Term]:
    """AdamW over this drafter's parameters (`params`, DFlash 2's included; default the DFlash drafter's)
    and the gradients' sync over the D drafters (ring all-reduce of the fp32 gradients: 2 (D - 1) / D of
    their bytes; FSDP: two all-gathers and a reduce-scatter)."""
    D = max(1, sharding.drafters)
    shard = D if sharding.fsdp else 1
    P = s.draft_params if params is None else params
    sync = 4 * P * (3 if sharding.fsdp else 2) * (D - 1) / D
    return {"adamw": Term("memory", ADAMW_BYTES * P / shard),
            "grad_sync": Term("network" if nodes > 1 else "link", sync)}


# -- the run's batches ----------------------------------------------------------------------------------

@dataclass
class PlanSample:
    """What the cost model reads of a run's plans: a sample of epoch 0's batches (evenly spaced), the
    batches with the most anchors and the most tokens, the batch count of every epoch and the means."""
    sample: list[BatchShape]
    worst: dict[str, BatchShape]
    batches: int  # over every epoch
    samples_per_batch: float
    tokens_per_batch: float
    anchors_per_batch: float
    source: str = ""


def sample_plans(cfg: Config, plans, lengths, anchorable, n: int = 256, source: str = "",
                 batches: int | None = None) -> PlanSample:
    """`PlanSample` of plans already built (the run's own, or those of `plan_sample_for`); `batches`: the
    run's batch count when `plans` are not all of its epochs."""
    lengths, anchorable = np.asarray(lengths), np.asarray(anchorable)
    anch = anchors_per_sample(anchorable, cfg.objective.num_anchors)
    first = plans[0]
    if not len(first):
        raise ValueError("the plan has no batch: nothing to predict")
    starts = first.offsets[:-1]
    tok = np.add.reduceat(lengths[first.indices], starts)
    anc = np.add.reduceat(anch[first.indices], starts)
    pick = np.unique(np.linspace(0, len(first) - 1, min(n, len(first))).round().astype(int))

    def shape(b):
        return plan_shape(first, int(b), lengths, anchorable, cfg.objective.num_anchors)

    return PlanSample(sample=[shape(b) for b in pick],
                      worst={"anchors": shape(np.argmax(anc)), "tokens": shape(np.argmax(tok))},
                      batches=batches or sum(len(p) for p in plans), samples_per_batch=len(first.indices) / len(first),
                      tokens_per_batch=float(tok.mean()), anchors_per_batch=float(anc.mean()), source=source)


def plan_sample_for(cfg: Config, samples: int = 902_000) -> PlanSample:
    """The plans of every epoch over the config's data (`memory.plan_lengths`: data.path, else the
    reference chat mix), sampled."""
    from dflash_dist.forecast.memory import plan_lengths, run_plans
    lengths, supervised, anchorable, source = plan_lengths(cfg, samples)
    plans, anchorable = run_plans(cfg, lengths, supervised, anchorable)
    return sample_plans(cfg, plans, lengths, anchorable, source=source)


# -- the split ------------------------------------------------------------------------------------------

def lockstep_seconds(per_batch: Sequence[float], drafters: int, seed: int = 0) -> float:
    """Expected time of a step of `drafters` drafters in lockstep: the mean over draws of the slowest of
    `drafters` batches drawn from `per_batch` (one drafter: the mean)."""
    t = np.asarray(per_batch, dtype=np.float64)
    if drafters <= 1 or len(t) == 1:
        return float(t.mean())
    draws = np.random.default_rng(seed).integers(0, len(t), size=(LOCKSTEP_DRAWS, drafters))
    return float(t[draws].max(axis=1).mean())


@dataclass
class Forecast:
    device: Device
    gpus_per_node: int
    nodes: int
    tensor_parallel: int
    per_batch: dict[str, dict[str, float]]  # role -> avg_s, worst_s, tflop, worst_tflop, gbytes, worst_gbytes
    # (the target: TFLOP of a whole replica, seconds and bytes of one of its ranks)
    splits: list[dict]  # one per drafters_per_node candidate
    configured: int | None  # roles.drafters_per_node (None: colocated)
    useful_tflop: float  # model FLOPs of an average batch, both roles
    ps: PlanSample = field(repr=False, default=None)

    def split(self, d: int) -> dict:
        return next(x for x in self.splits if x["drafters_per_node"] == d)

    @property
    def best(self) -> dict:
        return max(self.splits, key=lambda x: x["batches_per_s"])

    @property
    def slowdown(self) -> float | None:
        """How many times slower the configured split is predicted to be than the best (None: colocated)."""
        if self.configured is None or self.configured not in [x["drafters_per_node"] for x in self.splits]:
            return None
        return self.best["batches_per_s"] / self.split(self.configured)["batches_per_s"]

    def throughput(self, d: int) -> dict:
        r = self.split(d)["batches_per_s"]
        gpus = self.gpus_per_node * self.nodes
        return {"batches_per_s": r, "samples_per_s": r * self.ps.samples_per_batch,
                "tokens_per_s": r * self.ps.tokens_per_batch,
                "mfu": r * self.useful_tflop * 1e12 / (gpus * self.device.tflops * 1e12),
                "run_hours": self.ps.batches / r / 3600}

    def to_json(self) -> dict:
        best = self.best["drafters_per_node"]
        out = {"device": self.device.name, "gpus_per_node": self.gpus_per_node, "nodes": self.nodes,
               "tensor_parallel": self.tensor_parallel,
               "per_batch_tflop": {r: v["tflop"] for r, v in self.per_batch.items()},
               "per_batch": self.per_batch, "split": {"drafters_per_node": best, "targets_per_node":
                                                      self.gpus_per_node - best, "candidates": self.splits},
               "predicted": self.throughput(best), "configured": None, "batches": self.ps.batches,
               "plan": {"samples_per_batch": self.ps.samples_per_batch, "tokens_per_batch": self.ps.tokens_per_batch,
                        "anchors_per_batch": self.ps.anchors_per_batch, "source": self.ps.source}}
        if self.configured is not None and self.slowdown is not None:
            out["configured"] = {"drafters_per_node": self.configured, "slowdown": self.slowdown,
                                 **self.throughput(self.configured)}
        return out


def role_costs(cfg: Config, shapes: ModelShapes, batches: Sequence[BatchShape], precision: Precision,
               sharding: Sharding, nodes: int = 1) -> tuple[list[RoleCost], list[RoleCost]]:
    """(target costs, drafter costs) of each batch."""
    chunk = cfg.objective.anchor_chunk
    return ([target_terms(shapes, precision, cfg, w, sharding) for w in batches],
            [drafter_terms(shapes, precision, cfg, w, chunk, sharding, nodes) for w in batches])


def forecast(cfg: Config, shapes: ModelShapes, ps: PlanSample, device: Device, eff: Efficiency = Efficiency(),
             gpus_per_node: int = 8, nodes: int = 1, precision: Precision | None = None) -> Forecast:
    """Per-batch seconds of each role, every split of a node of `gpus_per_node` GPUs and its rate."""
    tp = max(1, cfg.model.target.tensor_parallel)
    p = precision or Precision.from_config(cfg, "cuda")  # a GPU job's dtypes and attention path
    base = Sharding.from_config(cfg)
    targets, drafters = role_costs(cfg, shapes, ps.sample, p, base, nodes)
    t_s = float(np.mean([c.seconds(device, eff) for c in targets]))
    d_batch = [c.seconds(device, eff, exclude=STEP_TERMS) for c in drafters]
    worst_t, _ = role_costs(cfg, shapes, [ps.worst["tokens"]], p, base, nodes)
    _, worst_d = role_costs(cfg, shapes, [ps.worst["anchors"]], p, base, nodes)
    per_batch = {
        "target": {"avg_s": t_s, "worst_s": worst_t[0].seconds(device, eff),
                   "tflop": tp * float(np.mean([c.flops for c in targets])) / 1e12,
                   "worst_tflop": tp * worst_t[0].flops / 1e12,
                   "gbytes": float(np.mean([c.bytes for c in targets])) / 1e9, "worst_gbytes": worst_t[0].bytes / 1e9},
        "drafter": {"avg_s": float(np.mean(d_batch)), "worst_s": worst_d[0].seconds(device, eff, exclude=STEP_TERMS),
                    "tflop": float(np.mean([c.flops for c in drafters])) / 1e12,
                    "worst_tflop": worst_d[0].flops / 1e12,
                    "gbytes": float(np.mean([c.bytes for c in drafters])) / 1e9, "worst_gbytes": worst_d[0].bytes / 1e9},
    }
    splits = []
    for d in candidate_splits(gpus_per_node, tp):
        D = d * nodes
        step = sum(t.amount / (device.rate(t.kind) * eff.of(t.kind))
                   for t in step_terms(shapes, replace(base, drafters=D), nodes, draft_param_count(shapes, cfg)).values())
        d_s = lockstep_seconds(d_batch, D) + step
        replicas = (gpus_per_node - d) // tp
        splits.append({"drafters_per_node": d, "target_replicas_per_node": replicas, "target_s": t_s,
                       "drafter_step_s": d_s, "batches_per_s": nodes * min(replicas / t_s, d / d_s),
                       "bottleneck": "targets" if replicas / t_s < d / d_s else "drafters"})
    useful = tp * float(np.mean([c.useful_flops for c in targets])) + float(np.mean([c.useful_flops for c in drafters]))
    configured = None if cfg.roles.mode == "colocated" else cfg.roles.drafters_per_node
    return Forecast(device=device, gpus_per_node=gpus_per_node, nodes=nodes, tensor_parallel=tp, per_batch=per_batch,
                    splits=splits, configured=configured, useful_tflop=useful / 1e12, ps=ps)


SLOW_WARN = 1.3  # the configured split predicted this many times slower than the best: warn at start


def start_message(fc: Forecast) -> tuple[bool, str]:
    """(warn, the start-of-run line): the predicted split and throughput for this layout."""
    head = (f"cost model ({fc.device.name}, {fc.nodes} x {fc.gpus_per_node} GPUs): per batch target "
            f"{fc.per_batch['target']['avg_s']:.3g} s, drafter {fc.per_batch['drafter']['avg_s']:.3g} s")
    if not fc.splits:  # one rank per node (colocated): no split exists
        return False, head
    best = fc.best
    b = fc.throughput(best["drafters_per_node"])
    line = (f"{head}; best roles.drafters_per_node={best['drafters_per_node']}: {b['samples_per_s']:.3g} samples/s, "
            f"{b['tokens_per_s']:.3g} tokens/s, MFU {100 * b['mfu']:.0f}%, {b['run_hours']:.3g} h")
    slow = fc.slowdown
    if slow is None:
        return False, line + " (roles.mode=colocated: no split to choose)"
    c = fc.throughput(fc.configured)
    line += (f"; configured {fc.configured}: {c['samples_per_s']:.3g} samples/s, {c['run_hours']:.3g} h "
             f"({fc.split(fc.configured)['bottleneck']} the bottleneck)")
    if slow > SLOW_WARN:
        return True, (line + f". The configured split is predicted {slow:.2f}x slower than the best: set "
                      f"roles.drafters_per_node={best['drafters_per_node']}")
    return False, line


def device_for(kind: str, name: str = "") -> Device:
    """The built-in device whose key is in `name` (torch.cuda.get_device_name), else H200 on CUDA (with a
    name saying so), or the nominal CPU."""
    if kind != "cuda":
        return DEVICES["cpu"]
    for key in ("h200", "h100"):
        if key in name.lower():
            return DEVICES[key]
    return replace(DEVICES["h200"], name=f"{name or 'unknown GPU'} (priced as H200)")


def predict_run(cfg: Config, ds, layout, device_type: str, device_name: str = "",
                batches: int | None = None) -> Forecast:
    """The forecast for a run's own layout and data (epoch 0's plan of dataset `ds`, `batches` in all)."""
    from dflash_dist.forecast.shapes import model_shapes
    from dflash_dist.plan.epochs import plan_for_epoch
    ps = sample_plans(cfg, [plan_for_epoch(ds, cfg, 0)], ds.lengths, ds.num_anchorable, source="the run's plan",
                      batches=batches)
    return forecast(cfg, model_shapes(cfg), ps, device_for(device_type, device_name),
                    gpus_per_node=layout.local_world_size, nodes=layout.num_nodes,
                    precision=Precision.from_config(cfg, device_type))


def log_start(fc: Forecast) -> None:
    """Rank 0's start-of-run lines: the predicted split and throughput; a warning when the configured
    split is predicted more than SLOW_WARN times slower than the best."""
    warn, line = start_message(fc)
    (log.warning if warn else log.info)("%s", line)


def predicted_per_batch(fc: Forecast) -> dict:
    """What the end-of-run balance advice prints beside its measurements: seconds of an average batch per
    role (the drafter's own compute, as a drafter measures it; `drafter_step_s` adds the wait for the
    slowest drafter of a step at the configured split), and the split the model finds best."""
    out = {"target_s_per_batch": fc.per_batch["target"]["avg_s"], "drafter_s_per_batch": fc.per_batch["drafter"]["avg_s"],
           "device": fc.device.name}
    if fc.splits:
        d = fc.configured if fc.configured in [x["drafters_per_node"] for x in fc.splits] else fc.best["drafters_per_node"]
        out |= {"drafter_step_s": fc.split(d)["drafter_step_s"], "best_drafters_per_node": fc.best["drafters_per_node"]}
    return out


def start_of_run(cfg: Config, ds, layout, device, batches: int) -> dict | None:
    """Rank 0 before the first batch: the forecast for this run's layout, logged (`log_start`), and what
    the end-of-run advice prints beside its measurements (None, with a warning, when it cannot be made:
    a forecast never stops a run)."""
    try:
        import torch
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        fc = predict_run(cfg, ds, layout, device.type, name, batches)
    except Exception as exc:  # noqa: BLE001 - a missing shape or an odd layout must not stop training
        log.warning("cost model: no forecast for this run (%s: %s)", type(exc).__name__, exc)
        return None
    log_start(fc)
    return predicted_per_batch(fc)
