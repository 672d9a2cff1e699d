"""The memory model: peak device memory per role, predicted from shapes before anything is loaded.

Each role's peak is a sum of named terms (bytes), each one counted from what the code allocates or
what autograd keeps for backward, tensor by tensor, at the worst batch of the real plan:

  drafter  parameters (fp32), gradients, AdamW (2 x fp32), autocast's bf16 copies of the weights
           (kept for backward), the frozen embedding + LM head (compute dtype), the packets in flight
           (transport.max_in_flight receive buffers), on rank 0 when it measures tau (and on every drafter
           of the synthetic corpus) the rest of the target's weights, the fused context and what its backward keeps, the
           labels; then per anchor chunk: the draft layers' saved activations (block rows, and the
           context rows every layer projects again), the larger of the loss chunk (loss_rows x V float32
           logits, plus their compute-dtype copy) and the backward's temporaries; allocator slack. DDP's
           gradient buckets are the gradients themselves (gradient_as_bucket_view), and AdamW's
           temporaries come after the chunks' activations are freed, far below this peak: left out.
  target   weights (compute dtype; a tensor-parallel replica's ranks each hold 1/tensor_parallel of them,
           save the norms and MoE routers, which every rank holds whole), the capture's transient
           activations at the batch's token count (a dense MLP, or a mixture-of-experts block: Qwen3-MoE,
           Mixtral), the captured features, the packets in flight, and with distillation labels the final
           hidden state and one chunk of logits; allocator slack.

The accounting follows the code as it is (dflash_dist.training.step, models.drafter, models.qwen3, objective,
transport); `python -m dflash_dist.bench.memory --validate` checks it against measurement on CPU
(bytes saved for backward and the peak of live tensor bytes) at a scaled shape. Model shapes come from
the config (tiny target), the target's config.json (hf), or a built-in table (`forecast/shapes.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from dflash_dist.config import Config, measures_tau
from dflash_dist.data.anchors import anchors_per_sample, tail_anchorable
from dflash_dist.forecast.job import BatchShape, Precision, Sharding
from dflash_dist.forecast.shapes import KNOWN_ARCHS, ModelShapes, model_shapes
from dflash_dist.forecast.variants import draft_param_count, forecast_of
from dflash_dist.models.variants import variant_of
from dflash_dist.parallel.transport import sends_final_hidden, target_label_width

GiB = 2 ** 30
SDPA_GROUP = 32  # blocks per SDPA call in the drafter's "sdpa" attention path (models.attention)
DISTILL_CHUNK = 4096  # tokens per logits chunk of the target's distillation labels (objective)
CUDA_RESERVED = 1.0 * GiB  # CUDA context, cuBLAS/NCCL workspaces: outside torch's tensors
SLACK = 0.10  # caching-allocator fragmentation, as a share of the step-dependent terms (CUDA only)


@dataclass
class RolePrediction:
    terms: dict[str, float]  # bytes
    worst: BatchShape

    @property
    def peak(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def peak_gib(self) -> float:
        return self.peak / GiB


@dataclass
class Prediction:
    roles: dict[str, RolePrediction]
    device_gib: float
    anchor_chunk: int
    best_anchor_chunk: int | None  # largest objective.anchor_chunk whose drafter fits (0: all at once)
    unsure: str | None = None  # why the model may be off (a custom target architecture), else None

    def fits_role(self, role: str) -> bool:
        return self.roles[role].peak_gib <= self.device_gib

    @property
    def fits(self) -> bool:
        return all(self.fits_role(r) for r in self.roles)

    def to_json(self) -> dict:
        return {"roles": {r: {"peak_gib": p.peak_gib, "fits": self.fits_role(r),
                              "terms_gib": {k: v / GiB for k, v in p.terms.items()}, "worst_batch": p.worst.summary()}
                          for r, p in self.roles.items()},
                "device_gib": self.device_gib, "fits": self.fits, "anchor_chunk": self.anchor_chunk,
                "best_anchor_chunk": self.best_anchor_chunk, "unsure": self.unsure}


# -- batches ------------------------------------------------------------------------------------------

def holds_whole_target(cfg: Config) -> bool:
    """Whether a drafter rank (the worst one) holds the whole target, as train.build loads it: rank 0 when
    the run measures tau, every drafter of the synthetic corpus; else the embedding and LM head only. The
    evaluation itself runs between steps, once the step's activations are freed; its one-sequence KV cache
    and activations are taken to stay below theirs and are not counted."""
    return cfg.model.target.tensor_parallel == 1 and (not cfg.data.path or measures_tau(cfg))


def worst_batches(cfg: Config, lengths: np.ndarray, supervised: np.ndarray, anchorable: np.ndarray | None = None,
                  epochs: Iterable[int] | None = None) -> dict[str, BatchShape]:
    """{"anchors": the batch with the most anchors, "tokens": the one with the most tokens} over the
    plans of `epochs` (default: every epoch of the run), built as the run builds them. Without
    `anchorable` (no loss mask at hand), each sample's supervised tokens are taken to be its tail
    (`tail_anchorable`)."""
    plans, anchorable = run_plans(cfg, lengths, supervised, anchorable, epochs)
    return worst_of_plans(cfg, plans, lengths, anchorable)


def run_plans(cfg: Config, lengths: np.ndarray, supervised: np.ndarray, anchorable: np.ndarray | None = None,
              epochs: Iterable[int] | None = None) -> tuple[list, np.ndarray]:
    """(the plans of `epochs` (default: every epoch of the run) built as the run builds them, the anchor
    positions per sample they were built with: `tail_anchorable` without `anchorable`). The memory
    and the cost model (dflash_dist.forecast.cost) both read their batches from here."""
    from dflash_dist.plan.epochs import build_plan, plan_kwargs
    lengths, supervised = np.asarray(lengths), np.asarray(supervised)
    anchorable = np.asarray(tail_anchorable(lengths, supervised) if anchorable is None else anchorable)
    plans = [build_plan(lengths, supervised, epoch=e, anchorable=anchorable, **plan_kwargs(cfg))
             for e in (epochs if epochs is not None else range(cfg.train.epochs))]
    return plans, anchorable


def worst_of_plans(cfg: Config, plans, lengths: np.ndarray, anchorable: np.ndarray) -> dict[str, BatchShape]:
    """`worst_batches` over plans already built (the run's own, counted at start); anchors per sample as
    the plan counts them (`data.anchors.anchors_per_sample`)."""
    lengths = np.asarray(lengths)
    anch = anchors_per_sample(np.asarray(anchorable), cfg.objective.num_anchors)
    best: dict[str, tuple[int, BatchShape]] = {}
    for plan in plans:
        starts = plan.offsets[:-1]
        if not len(starts):
            continue
        tok = np.add.reduceat(lengths[plan.indices], starts)
        anc = np.add.reduceat(anch[plan.indices], starts)
        for key, per in (("anchors", anc), ("tokens", tok)):
            b = int(np.argmax(per))
            if key not in best or per[b] > best[key][0]:
                idx = plan.batch(b)
                best[key] = (int(per[b]), BatchShape(
                    tokens=int(tok[b]), seqs=len(idx), anchors=int(anc[b]),
                    seq_lens=tuple(int(x) for x in lengths[idx]), seq_anchors=tuple(int(x) for x in anch[idx])))
    if not best:
        raise ValueError("the plan has no batch: nothing to predict")
    return {k: v[1] for k, v in best.items()}


def plan_lengths(cfg: Config, samples: int = 902_000, seed: int = 0):
    """(lengths, supervised, anchorable or None, source): the prepared dataset when data.path is set,
    else the reference chat mix (data.synthetic.chat_lengths) at the config's token budget."""
    if cfg.data.path:
        from dflash_dist.data.disk import open_dataset
        ds = open_dataset(cfg.data.path)
        return (np.asarray(ds.lengths), np.asarray(ds.num_supervised), ds.num_anchorable,
                f"data.path={cfg.data.path}")
    from dflash_dist.data.synthetic import chat_lengths
    lengths, sup = chat_lengths(samples, cfg.plan.token_budget, seed)
    return lengths, sup, None, f"chat mix ({samples:,} samples, bench.plan, seed {seed})"


# -- drafter ------------------------------------------------------------------------------------------

def _norm_saved(width: int, groups: int, in_bytes: int) -> int:
    """RMSNorm (models.qwen3) per row: pow keeps the float32 input, mul keeps it and the rsqrt, the
    weight's mul keeps the normalised input cast back to the input's dtype."""
    return 4 * width + in_bytes * width + 4 * groups


def _linear_inputs(width: int, calls: int, c: int) -> int:
    """What matmuls keep of one float32 input used by `calls` linears: under autocast each call keeps its
    own compute-dtype cast (autocast caches casts of weights only); in float32 the tensor itself."""
    return calls * c * width if c != 4 else 4 * width


def _dims(s: ModelShapes) -> tuple[int, int, int, int, int, int]:
    return (s.hidden, s.draft_heads * s.draft_head_dim, s.draft_kv_heads * s.draft_head_dim, s.draft_intermediate,
            s.draft_heads, s.draft_kv_heads)


def block_row_bytes(s: ModelShapes, p: Precision) -> int:
    """Saved bytes per block row (query) per draft layer, attention's per-row part included."""
    H, Q, K, I, h, hkv = _dims(s)
    c = p.drafter_compute
    per = (_norm_saved(H, 1, 4) + _linear_inputs(H, 3, c)  # input norm; h kept by q/k/v projections
           + _norm_saved(Q, h, c) + _norm_saved(K, hkv, c)  # q_norm, k_norm (RoPE keeps only cos/sin)
           + _norm_saved(H, 1, 4) + _linear_inputs(H, 2, c)  # post-attention norm; h2 kept by gate/up
           + 4 * c * I)  # MLP: gate out, silu out, up out, their product (down_proj's input)
    if p.attention == "flex":
        # q, k_blk, v_blk cast to the kernel dtype and kept; its output and log-sum-exp; the contiguous
        # output o_proj keeps.
        per += c * Q + 2 * c * K + c * Q + 4 * h + c * Q
    else:
        # sdpa: q itself, the call's output, its log-sum-exp, the concatenated output o_proj keeps; the
        # block part of each call's concatenated k/v is in `sdpa_call_bytes`.
        per += c * Q + c * Q + 4 * h + c * Q
    return per


def context_row_bytes(s: ModelShapes, p: Precision) -> int:
    """Saved bytes per context row per draft layer per chunk: every layer projects the chunk's context
    rows to keys and values (k_norm's saves; under autocast, two casts of ctx)."""
    H, Q, K, I, h, hkv = _dims(s)
    c = p.drafter_compute
    per = _norm_saved(K, hkv, c) + (2 * c * H if c != 4 else 0)
    if p.attention == "flex":
        per += 2 * c * K  # the context part of the concatenated k and v the kernel keeps
    return per


def chunk_context_rows(worst: BatchShape, chunk: int) -> int:
    """The most context rows one anchor chunk projects: from its first anchor's sequence start to its last
    anchor (anchors come in packed order, step.py); without per-sequence shapes, the whole batch."""
    if not worst.seq_anchors or chunk <= 0 or chunk >= worst.anchors:
        return worst.tokens
    starts = [0]
    for L in worst.seq_lens[:-1]:
        starts.append(starts[-1] + L)
    where = []  # (sequence start, packed position of the anchor) per anchor, in packed order
    k = 0
    for seq, n in enumerate(worst.seq_anchors):
        pos = sorted(worst.anchor_pos[k:k + n]) if worst.anchor_pos else [worst.seq_lens[seq]] * n
        where += [(starts[seq], starts[seq] + p) for p in pos]
        k += n
    return max(where[min(a + chunk, len(where)) - 1][1] - where[a][0] for a in range(0, len(where), chunk))


def _runs(seq_anchors: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Per chunk, the (sequence, first anchor in it, blocks) of each SDPA call: runs of one sequence's
    anchors cut at SDPA_GROUP blocks and at chunk boundaries."""
    chunks, cur, fill = [], [], 0
    for seq, n in enumerate(seq_anchors):
        done = 0
        while done < n:
            take = min(n - done, chunk - fill)
            for a in range(0, take, SDPA_GROUP):
                cur.append((seq, done + a, min(SDPA_GROUP, take - a)))
            done, fill = done + take, fill + take
            if fill == chunk:
                chunks.append(cur)
                cur, fill = [], 0
    if cur:
        chunks.append(cur)
    return chunks


def sdpa_call_bytes(s: ModelShapes, p: Precision, worst: BatchShape, chunk: int) -> int:
    """The sdpa path's per-call saves of the worst chunk, per layer: each call concatenates its
    sequence's context up to the call's last anchor with its blocks (keys and values, kept) and keeps
    its mask as an additive bias in the compute dtype (queries x keys)."""
    H, Q, K, I, h, hkv = _dims(s)
    c, B = p.drafter_compute, s.block_size
    if not worst.seq_anchors:
        raise ValueError("the sdpa attention term needs the batch's per-sequence anchors")
    # Context rows each anchor sees: the real ones when known, else its whole sequence (an upper bound).
    pos: list[list[int]] = []
    k = 0
    for L, n in zip(worst.seq_lens, worst.seq_anchors):
        pos.append(sorted(worst.anchor_pos[k:k + n]) if worst.anchor_pos else [L] * n)
        k += n
    worst_bytes = 0
    for calls in _runs(worst.seq_anchors, chunk):
        total = 0
        for seq, first, nb in calls:
            keys = pos[seq][first + nb - 1] + nb * B
            total += 2 * c * K * keys + c * nb * B * keys
        worst_bytes = max(worst_bytes, total)
    return worst_bytes


def feature_blocks(s: ModelShapes, cfg: Config) -> int:
    """H-wide blocks of each token's features on the wire and on the drafter: the captured layers', and
    the target's final-normed last hidden state where `sends_final_hidden` says so (a variant that asks
    for it, DSpark's teacher; objective.labels=target_full), as parallel/transport.py's packet_spec counts them."""
    return len(s.feature_layers) + int(_sends_final(cfg))


def _sends_final(cfg: Config) -> bool:
    return sends_final_hidden(cfg.objective.labels, variant_of(cfg.model.draft.variant).needs.final_hidden)


def runs_whole_target(cfg: Config) -> bool:
    """Whether a target's forward runs past the last captured layer to its final norm: the target's
    predictions as labels read its logits, the final state sent (`sends_final_hidden`) is its last state
    (training/capture.py)."""
    return target_label_width(cfg.objective.labels, cfg.objective.soft_top_k) > 0 or _sends_final(cfg)


def chunk_peak(s: ModelShapes, p: Precision, cfg: Config, worst: BatchShape, a: int) -> tuple[float, float]:
    """(saved, transient) bytes at the peak of one chunk of `a` anchors of `worst`: what autograd holds
    then (the draft layers' and the tail's saves), and the loss chunk or the backward's temporaries on top."""
    H, c, V, L = s.hidden, p.drafter_compute, s.vocab, s.draft_layers
    R = a * s.block_size
    row = block_row_bytes(s, p)
    span = chunk_context_rows(worst, a)
    ctx = (context_row_bytes(s, p) + 2 * 4 * s.draft_head_dim) * span  # + the context rows' RoPE cos/sin
    attn_calls = sdpa_call_bytes(s, p, worst, a) if p.attention == "sdpa" else 0
    own = forecast_of(cfg)  # the variant's own modules (its Variant.forecast)
    per_layer = (row + own.layer_row_bytes(s, p, cfg)) * R + ctx + attn_calls
    # After the layers: the embedding output (float32, the first layer's input), the final norm, the
    # loss's saved input gradient (rows with a label) and its index, block RoPE cos/sin.
    tail = R * (_norm_saved(H, 1, 4)) + (R - a) * (c * H + 8) + 2 * 4 * R * s.draft_head_dim
    # The first layer's input (the frozen embedding's output) needs no gradient: its input norm keeps
    # only the normalised rows for the weight's gradient, not the input and the rsqrt.
    tail -= R * (4 * H + 4)
    rows = min(cfg.objective.loss_rows, R)
    chunk_own = own.chunk_bytes(s, p, cfg, rows, R, a)
    tail += chunk_own.saved
    # target_full (objective._distill_rows): the target's logits, the slot's and p_t, three float32 (rows, V),
    # and the gradient's cast to the compute dtype beside them (none in float32).
    full = cfg.objective.labels == "target_full"
    loss_chunk = chunk_own.loss or rows * V * ((12 if full else 4) + (c if c != 4 else 0))
    loss_chunk += R * c * H if c != 4 else 0
    # Backward peaks at its start, before any saved tensor is freed: the hidden states' gradient (and its
    # float32 cast) and the final norm's float32 temporaries, about five (R, H) float32 in all (measured).
    backward = 5 * 4 * R * H
    if cfg.model.draft.checkpoint_layers:
        # Each layer keeps only its input; backward recomputes one layer at a time, after the tail's
        # saves are gone. Two candidate peaks: the loss at the forward's end, a layer's recompute.
        kept = L * 4 * H * R
        phases = (kept + tail, max(loss_chunk, chunk_own.after)), (kept + per_layer, backward)
    else:
        phases = (L * per_layer + tail, max(loss_chunk, chunk_own.after, backward)),
    return max(phases, key=sum)


def drafter_terms(s: ModelShapes, p: Precision, cfg: Config, worst: BatchShape, chunk: int,
                  sharding: Sharding = Sharding()) -> dict[str, float]:
    """Peak bytes of a drafter rank by term for `worst` with `chunk` anchors per chunk (0 = all)."""
    H, c, B, V, N = s.hidden, p.drafter_compute, s.block_size, s.vocab, worst.tokens
    tb, xb = p.target_bytes, p.transfer_bytes
    a = worst.anchors if chunk <= 0 else min(chunk, worst.anchors)
    shard = sharding.drafters if sharding.fsdp else 1
    P = draft_param_count(s, cfg)
    nf = feature_blocks(s, cfg)
    w = target_label_width(cfg.objective.labels, cfg.objective.soft_top_k)
    meta = 8 * (2 * N + worst.seqs + 1 + w * N) + (4 * cfg.objective.soft_top_k * N if w > 1 else 0)
    t: dict[str, float] = {
        "params": 4 * P / shard,
        "grads": 4 * P / shard,
        "adamw": 8 * P / shard,
        "ddp_buckets": 4 * P if sharding.ddp and not sharding.fsdp else 0,
        # autocast's bf16 copies of the weights, kept by the matmuls for backward
        "weight_casts": c * P if p.autocast else 0,
        "embed_head": V * H * tb * (1 if s.tied else 2),
        # The rest of the target, on the drafter ranks that hold it whole (`holds_whole_target`).
        "whole_target": (s.target_params - V * H * (1 if s.tied else 2)) * tb if holds_whole_target(cfg) else 0,
        "packets": cfg.transport.max_in_flight * (N * nf * H * xb + meta),
        # fc output through hidden_norm (kept), the context (N, H) float32 and its gradient
        "context": N * (_norm_saved(H, 1, c) + 8 * H),
        # labels and weights for the batch, soft targets (probs float32, ids int64)
        "labels": worst.anchors * B * (12 + (12 * cfg.objective.soft_top_k if w > 1 else 0)),
    }
    # what autograd holds at the peak, and the loss chunk or the backward's temporaries on top
    t["activations"], t["transient"] = chunk_peak(s, p, cfg, worst, a)
    if p.device == "cuda":
        t["slack"] = SLACK * (t["activations"] + t["transient"] + t["context"] + t["packets"])
        t["cuda_reserved"] = CUDA_RESERVED
    return t


# -- target -------------------------------------------------------------------------------------------

def moe_block_bytes(s: ModelShapes, tokens: int, c: int, tp: int = 1) -> float:
    """Peak bytes a sparse MoE block allocates over its input in a forward without grad, as transformers
    5 runs it (models/qwen3_moe/modeling_qwen3_moe.py Qwen3MoeSparseMoeBlock, mixtral alike) with its
    default experts implementation, "grouped_mm" (integrations/moe.py grouped_mm_experts_forward, which
    HFTarget keeps; the "eager" loop's peak, its (N, k, E+1) int64 one-hot mask, is far smaller: 8 KiB a
    token for Qwen3-30B-A3B against 128 KiB here). Over the block: the router's (N, E) logits (kept by
    the block while the experts run; its float32 softmax is freed before) and the top-k weights and ids.
    In grouped_mm, for S = N*k token-expert pairs: the sorted
    expert ids, their permutation and histc's 32-bit copy of them, the permuted weights, and the
    gathered inputs (S, H), which stay alive to the end. It then peaks either at the gate (the gate_up
    output (S, 2I), silu(gate) and the product (S, I) each) or at the end (the down projection's output,
    it times the weights, and that reordered: three more (S, H), with the inverse permutation). With
    tensor parallelism (transformers' "moe_tp_experts": every expert split along I) only the (S, I)
    tensors shrink; every rank still gathers all S rows (expert parallelism's "all_reduce" dispatch also
    keeps all S rows, those of other ranks' experts as masked sentinels). Mixtral's routing weights stay
    float32, and so the weighted outputs do too."""
    N, E, k, H = tokens, s.experts, s.experts_per_token, s.hidden
    S, inter = N * k, s.moe_intermediate / tp
    w = 4 if s.arch == "mixtral" else c  # routing weights' element size
    routing = N * E * c + N * k * (w + 8)
    ints = S * (8 + 8 + 4 + w)
    gate = S * H * c + 4 * S * inter * c
    end = 2 * S * H * c + 2 * S * H * max(c, w) + 8 * S
    return routing + ints + max(gate, end)


def target_terms(s: ModelShapes, p: Precision, cfg: Config, worst: BatchShape,
                 sharding: Sharding = Sharding()) -> dict[str, float]:
    """Peak bytes of a target rank by term for `worst` (its token count)."""
    H, Q, K, I = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    c, xb, N, V = p.target_bytes, p.transfer_bytes, worst.tokens, s.vocab
    tp = max(1, sharding.tensor_parallel)
    ids = set(s.feature_layers)
    nf = feature_blocks(s, cfg)
    w = target_label_width(cfg.objective.labels, cfg.objective.soft_top_k)
    distill = w > 0  # the target computes logits for its labels (target_full's are the drafter's)
    feats = N * nf * H * c
    # A decoder layer without grad peaks in its MLP: the residual stream, the normed input, then
    # silu(gate), up and their product side by side (gate itself is freed by silu); a sparse layer at its
    # MoE block (`moe_block_bytes`). The built-in target's layer (models.qwen3) also still holds its
    # attention's locals there (normed input, q, k, v); transformers' layers do not. The attention half
    # stays below this whenever I >= H. RoPE's cos/sin for the batch live through the whole capture.
    held = H + Q + 2 * K if s.arch == "tiny" else 0
    rope = 2 * N * s.head_dim * c
    dense = N * ((2 * H + held) * c + 3 * I * c / tp) + rope
    sparse = N * 2 * H * c + moe_block_bytes(s, N, c, tp) + rope if s.experts else 0.0
    sparse_ids = set(s.sparse_layers)
    # While layer i runs, the outputs captured before it are held, and its input (the capture loop's
    # variable) unless that input is itself a captured output. The forward stops after the last captured
    # layer, or with distillation labels runs on to the last layer; the concatenation then holds every
    # captured output, the features and the last output.
    last = s.layers if runs_whole_target(cfg) else max(ids) + 1
    capture = 2 * feats + (N * H * c if last - 1 not in ids else 0)
    before = 0  # captured outputs of the layers before i
    for i in range(last):
        layer = sparse if i in sparse_ids else dense
        capture = max(capture, (before + (i - 1 not in ids)) * N * H * c + layer)
        before += i in ids
    split, whole = s.target_param_split()
    t: dict[str, float] = {
        "weights": (split / tp + whole) * c,
        "batch": 8 * 3 * N,  # input ids, loss mask, positions
        "capture": capture,
        "packets": cfg.transport.max_in_flight * sharding.drafters_per_target
        * (N * nf * H * xb + 8 * (2 * N + worst.seqs + 1 + w * N) + (4 * w * N if w > 1 else 0)),
    }
    if distill:  # after the capture: features kept, the final hidden state and one chunk of logits
        t["distill"] = max(0.0, N * H * c + min(DISTILL_CHUNK, N) * V * c - (capture - feats))
    if p.device == "cuda":
        t["slack"] = SLACK * (t["capture"] + t["packets"])
        t["cuda_reserved"] = CUDA_RESERVED
    return t


# -- prediction --------------------------------------------------------------------------------------

def _drafter(s, p, cfg, worsts, chunk, sharding) -> RolePrediction:
    preds = [RolePrediction(drafter_terms(s, p, cfg, w, chunk, sharding), w) for w in worsts]
    return max(preds, key=lambda r: r.peak)


def largest_anchor_chunk(s: ModelShapes, p: Precision, cfg: Config, worsts: Sequence[BatchShape], device_gib: float,
                         sharding: Sharding = Sharding()) -> int | None:
    """The largest objective.anchor_chunk whose drafter peak fits `device_gib` (0 when the whole batch
    fits at once; None when not even one anchor per chunk fits)."""
    most = max(w.anchors for w in worsts)

    def fits(chunk: int) -> bool:
        return _drafter(s, p, cfg, worsts, chunk, sharding).peak_gib <= device_gib

    if fits(0):
        return 0
    if not fits(1):
        return None
    lo, hi = 1, most  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def predict(cfg: Config, shapes: ModelShapes, worst: BatchShape | Sequence[BatchShape], device_gib: float,
            sharding: Sharding | None = None, precision: Precision | None = None) -> Prediction:
    """Each role's peak at its worst batch (the max over `worst` when several are given)."""
    worsts = [worst] if isinstance(worst, BatchShape) else list(worst)
    sharding = sharding or Sharding.from_config(cfg)
    p = precision or Precision.from_config(cfg)
    chunk = cfg.objective.anchor_chunk
    target = max((RolePrediction(target_terms(shapes, p, cfg, w, sharding), w) for w in worsts), key=lambda r: r.peak)
    roles = {"target": target, "drafter": _drafter(shapes, p, cfg, worsts, chunk, sharding)}
    unsure = None if shapes.arch in KNOWN_ARCHS else \
        f"target architecture {shapes.arch!r} is not one the capture accounting describes ({', '.join(KNOWN_ARCHS)})"
    return Prediction(roles=roles, device_gib=device_gib, anchor_chunk=chunk,
                      best_anchor_chunk=largest_anchor_chunk(shapes, p, cfg, worsts, device_gib, sharding),
                      unsure=unsure)


def predict_for_plan(cfg: Config, lengths: np.ndarray, supervised: np.ndarray, device_gib: float,
                     anchorable: np.ndarray | None = None, sharding: Sharding | None = None,
                     target_shape: str | None = None) -> Prediction:
    """`predict` at the worst batches of the run's own plans (what train's pre-flight calls with its
    dataset's lengths, supervised and, when it has them, anchorable counts)."""
    worst = worst_batches(cfg, lengths, supervised, anchorable)
    return predict(cfg, model_shapes(cfg, target_shape), list(worst.values()), device_gib, sharding)


def preflight_message(pred: Prediction, role: str) -> str | None:
    """None when `role` fits; else what to change, naming the keys."""
    r = pred.roles[role]
    if r.peak_gib <= pred.device_gib:
        return None
    top = sorted(r.terms.items(), key=lambda kv: -kv[1])[:3]
    where = ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)
    head = (f"memory pre-flight: the {role} role needs {r.peak_gib:.1f} GiB at its worst batch "
            f"({r.worst.tokens:,} tokens, {r.worst.anchors:,} anchors) but the device has {pred.device_gib:.1f} GiB "
            f"(largest terms, GiB: {where}). ")
    if role == "drafter":
        best = pred.best_anchor_chunk
        hint = ("no objective.anchor_chunk fits: lower plan.token_budget or objective.loss_rows" if best is None
                else f"set objective.anchor_chunk={best} (now {pred.anchor_chunk})")
        whole = (", or train.eval_prompts=0 (rank 0 then holds the target's head only, not its whole "
                 f"{r.terms['whole_target'] / GiB:.1f} GiB, and tau is measured after the run)"
                 if r.terms.get("whole_target") else "")
        return head + hint + ", or model.draft.checkpoint_layers=true, or a smaller plan.token_budget" + whole
    return head + "lower plan.token_budget (the capture and the packets follow it), transport.max_in_flight, " \
                  "or raise model.target.tensor_parallel"


def gib_table(pred: Prediction) -> str:
    """One row per role: each term in GiB, the total and whether it fits."""
    names = list(dict.fromkeys(k for r in pred.roles.values() for k, v in r.terms.items() if v))
    head = ["role"] + names + ["total", "fits"]
    rows = [[role] + [f"{r.terms[n] / GiB:.2f}" if n in r.terms else "-" for n in names]
            + [f"{r.peak_gib:.2f}", "yes" if pred.fits_role(role) else "NO"] for role, r in pred.roles.items()]
    width = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(x.rjust(wd) for x, wd in zip(cells, width))  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def drafter_saved(s: ModelShapes, p: Precision, cfg: Config, worst: BatchShape, chunk: int) -> float:
    """Bytes autograd holds for backward at the drafter's peak (parameters and the packet left out): one
    chunk's activations, what the context's backward keeps (and in float32 the context itself, which the
    layers' projections keep), autocast's weight copies."""
    t = drafter_terms(s, p, cfg, worst, chunk)
    N, H, c = worst.tokens, s.hidden, p.drafter_compute
    return t["activations"] + N * _norm_saved(H, 1, c) + (4 * N * H if c == 4 else 0) + t["weight_casts"]
