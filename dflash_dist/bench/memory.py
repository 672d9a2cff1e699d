"""Predicted peak device memory per role at the worst batch of the real plan, and a check on CPU.

    python -m dflash_dist.bench.memory --config configs/qwen3_8b.yaml [key=value ...] [--gpu-mem-gib 141]
        [--target-shape qwen3-8b] [--json PATH] [--validate]

The worst batches are those of the real plan (`plan.build_plan` over every epoch): of the prepared dataset
when data.path is set, else of the benchmark's 902K chat mix (bench.plan). The batch with the most anchors
and the one with the most tokens are both evaluated; each role's peak is the larger. The table has one
row per role and one column per term (GiB; memory.py says what each holds); the JSON adds the worst
batches and the largest objective.anchor_chunk that fits.

--validate runs the real code on CPU at a scaled shape (the "sdpa" attention path), once in float32 and
once with a bf16 target and the drafter under CPU bf16 autocast (a CUDA run's dtypes), and prints
predicted / measured per role: the target's `capture` (peak of live tensor bytes, one packet held as the
sender's queue would) and the drafter's `step.drafter_step` + AdamW step (peak of live tensor bytes, and
the peak of bytes saved for backward), for the chunked and the unchunked step side by side, with their
step times. Live bytes are counted per storage from every op's outputs (a TorchDispatchMode; a storage's
bytes are released when it dies), saved bytes through torch.autograd.graph.saved_tensors_hooks (each
storage once, parameters and the step's inputs excluded). Temporaries inside a single kernel are not
tensors and are not seen. It then checks a transformers target's capture the same way
(`validate_hf_capture`: a tiny Qwen3-MoE built from a config, its config.json read as a real model's).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dflash_dist.config import Config, ConfigError, load_config, ranged
from dflash_dist.forecast import memory as M
from dflash_dist.forecast.shapes import TARGET_SHAPES, check_target_split, model_shapes
from dflash_dist.io.files import check_output_path, write_json

# -- measurement --------------------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """The peak of live tensor bytes while active: every op output's storage counts once, until it dies.
    Tensors that exist before must be `track`ed to count (parameters, inputs)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def track(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self.live or st.nbytes() == 0:
                continue
            self.live[key] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type != "meta"))
        return out


class SavedBytes:
    """The peak of bytes autograd holds for backward while active (each storage once), leaving out the
    storages of `exclude` (parameters, the step's inputs: they are alive whatever autograd does)."""

    def __init__(self, exclude=()):
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.skip and key not in self.live and st.nbytes():
            self.live[key] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._release, key)
        return t

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


# -- the scaled shape ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Scaled:
    """A CPU-sized job: a tiny target and a drafter of the reference's proportions (I = 3H, 4:1 GQA...)."""
    hidden: int = 256
    vocab: int = 8192
    intermediate: int = 768
    target_layers: int = 4
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    draft_layers: int = 2
    seqs: int = 4
    seq_len: int = 600
    prompt: int = 50
    num_anchors: int = 512
    anchor_chunk: int = 64
    loss_rows: int = 1024
    # bf16 target and features, drafter under CPU autocast: the dtype accounting of a CUDA run (on the
    # sdpa path; flex has no CPU backward).
    bf16: bool = False
    labels: str = "data"  # objective.labels
    # model.draft.checkpoint_layers. Saved bytes are then not measured: the checkpoint's own
    # saved-tensor hooks take over inside each layer, so ours see only the layers' inputs.
    checkpoint_layers: bool = False

    @property
    def precision(self) -> M.Precision:
        b = 2 if self.bf16 else 4
        return M.Precision(device="cpu", target_bytes=b, transfer_bytes=b, drafter_compute=b, attention="sdpa")

    def overrides(self) -> list[str]:
        return [f"model.target.vocab_size={self.vocab}", f"model.target.hidden_size={self.hidden}",
                f"model.target.intermediate_size={self.intermediate}", f"model.target.num_layers={self.target_layers}",
                f"model.target.num_heads={self.heads}", f"model.target.num_kv_heads={self.kv_heads}",
                f"model.target.head_dim={self.head_dim}", f"model.draft.num_layers={self.draft_layers}",
                f"model.draft.target_layer_ids=[1,{self.target_layers - 2}]",
                f"model.target.dtype={'bfloat16' if self.bf16 else 'float32'}",
                f"objective.num_anchors={self.num_anchors}", f"objective.anchor_chunk={self.anchor_chunk}",
                f"objective.loss_rows={self.loss_rows}", "transport.max_in_flight=1", "transport.dtype=auto",
                f"plan.token_budget={self.seqs * self.seq_len}", f"objective.labels={self.labels}",
                f"model.draft.checkpoint_layers={self.checkpoint_layers}"]


ONE_RANK = M.Sharding(drafters=1, drafters_per_target=1)  # one drafter, one packet held


def _batch(sc: Scaled):
    from dflash_dist.data.collate import PackedBatch
    g = torch.Generator().manual_seed(0)
    n = sc.seqs * sc.seq_len
    ids = torch.randint(0, sc.vocab - 1, (n,), generator=g)
    mask = (torch.arange(n) % sc.seq_len) >= sc.prompt
    cu = torch.arange(sc.seqs + 1) * sc.seq_len
    return PackedBatch(ids, mask, cu)


def _packet_tensors(packet) -> list[torch.Tensor]:
    """The tensors of (features, TargetLabels or None): what a packet in flight holds."""
    feats, labels = packet
    return [feats] + ([] if labels is None else [t for t in (labels.ids, labels.values) if t is not None])


def validate(sc: Scaled = Scaled(), time_steps: bool = True, reps: int = 3) -> dict:
    """Predicted vs measured at the scaled shape; see the module docstring."""
    from dflash_dist.models.build import draft_spec
    from dflash_dist.models.qwen3 import TinyQwen3
    from dflash_dist.training.objective import anchor_generator, draw_anchors

    cfg = load_config(None, sc.overrides())
    target = TinyQwen3(cfg.model.target).to(torch.bfloat16 if sc.bf16 else torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    batch = _batch(sc)
    anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, sc.num_anchors,
                                      anchor_generator(0, 0, 0))
    seq_lens = tuple(int(x) for x in (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]))
    seq_anchors = tuple(int(x) for x in (anchor_cu[1:] - anchor_cu[:-1]))
    starts = torch.repeat_interleave(batch.cu_seqlens[:-1], anchor_cu[1:] - anchor_cu[:-1])
    worst = M.BatchShape(tokens=batch.num_tokens, seqs=batch.num_seqs, anchors=anchors.numel(), seq_lens=seq_lens,
                         seq_anchors=seq_anchors, anchor_pos=tuple((anchors - starts).tolist()))
    out: dict = {"shape": sc.__dict__, "batch": worst.summary()}
    spec = draft_spec(cfg, target)
    out["target"], packet = _validate_target(sc, cfg, worst, target, list(spec.target_layer_ids), batch)
    out.update(_validate_drafter(sc, cfg, worst, target, spec, batch, packet, anchors, anchor_cu, time_steps, reps))
    if not sc.checkpoint_layers:
        out["saved_ratio"] = out["chunked"]["saved_measured"] / out["unchunked"]["saved_measured"]
    if time_steps:
        out["time_ratio"] = out["chunked"]["step_s"] / out["unchunked"]["step_s"]
    return out


def _validate_target(sc: Scaled, cfg: Config, worst: M.BatchShape, target, layer_ids, batch):
    """The target's peak with one packet held (the sender's queue at max_in_flight = 1) while it captures
    the next: ({"predicted", "measured"}, the packet the drafter then trains on)."""
    from dflash_dist.training.capture import capture_for_drafter
    dtype = torch.bfloat16 if sc.bf16 else torch.float32

    def capture():
        return capture_for_drafter(target, batch, layer_ids, cfg.objective, dtype)

    held = capture()
    with LiveBytes() as live:
        live.track(*target.parameters(), *_packet_tensors(held), batch.input_ids, batch.loss_mask, batch.cu_seqlens)
        packet = capture()
    pred = M.target_terms(model_shapes(cfg), sc.precision, cfg, worst, ONE_RANK)
    return {"predicted": sum(pred.values()), "measured": live.peak}, packet


def _validate_drafter(sc: Scaled, cfg: Config, worst: M.BatchShape, target, spec, batch, packet, anchors, anchor_cu,
                      time_steps: bool, reps: int) -> dict:
    """The drafter step's peak live and saved bytes, chunked and unchunked (and their step times)."""
    from dflash_dist.models.build import build_drafter
    from dflash_dist.training.step import StepBatch, drafter_step, step_settings
    feats, labels = packet
    model = build_drafter(spec, target, cfg.model.draft.seed, torch.device("cpu"), sc.checkpoint_layers)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:  # the optimizer's state exists from the first step on
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    settings = replace(step_settings(cfg, spec, torch.bfloat16 if sc.bf16 else None),
                       loss_rows=sc.loss_rows, batch_mean=True)

    def step(chunk: int):
        drafter_step(model, StepBatch(batch, feats, labels, anchors, anchor_cu), replace(settings, anchor_chunk=chunk))

    out: dict = {}
    for name, chunk in (("chunked", sc.anchor_chunk), ("unchunked", 0)):
        with LiveBytes() as live, SavedBytes(exclude=params + [feats]) as saved:
            live.track(*params, *state, model.lm_head.weight, model._embed.weight, *_packet_tensors(packet),
                       batch.input_ids, batch.loss_mask, batch.cu_seqlens)
            step(chunk)
            opt.step()
            opt.zero_grad(set_to_none=True)
        c = replace(cfg, objective=replace(cfg.objective, anchor_chunk=chunk))
        shapes, P = model_shapes(cfg), sc.precision
        terms = M.drafter_terms(shapes, P, c, worst, chunk, ONE_RANK)
        out[name] = {"predicted": sum(terms.values()), "measured": live.peak,
                     "saved_predicted": M.drafter_saved(shapes, P, c, worst, chunk),
                     "saved_measured": None if sc.checkpoint_layers else saved.peak, "terms": terms}
    if time_steps:  # alternating, best of `reps`: a shared machine's noise hits both sides alike
        times: dict[str, list[float]] = {"chunked": [], "unchunked": []}
        for _ in range(reps):
            for name, chunk in (("chunked", sc.anchor_chunk), ("unchunked", 0)):
                t0 = time.perf_counter()
                step(chunk)
                times[name].append(time.perf_counter() - t0)
                opt.zero_grad(set_to_none=True)
        for name, ts in times.items():
            out[name]["step_s"] = min(ts)
    return out


def tiny_moe_config(**overrides):
    """A tiny transformers Qwen3-MoE config (random weights are built from it): 16 experts, 4 per token."""
    from transformers import Qwen3MoeConfig
    kw = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
              head_dim=64, intermediate_size=384, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96,
              tie_word_embeddings=False)
    return Qwen3MoeConfig(**(kw | overrides))


def validate_hf_capture(model_config, directory: str | Path, layer_ids: list[int], bf16: bool = False,
                        labels: str = "data", seqs: int = 2, seq_len: int = 600) -> dict:
    """The target role on CPU for a tiny transformers model (random weights) built from `model_config` (a
    transformers config, e.g. `tiny_moe_config()`): its config.json is written to `directory` and read by
    the memory model as a real model's would be; the model runs `capture_for_drafter` through `HFTarget`
    with one packet held. Returns {"terms": predicted bytes by term, "weights": measured parameter bytes,
    "measured": peak live bytes, "capture": the measured peak less what was live before (weights, the
    held packet, the batch's ids and mask)}."""
    from transformers import AutoModelForCausalLM

    from dflash_dist.models.hf_target import HFTarget
    from dflash_dist.training.capture import capture_for_drafter
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_config.to_json_file(str(directory / "config.json"))
    dtype = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    target = HFTarget(AutoModelForCausalLM.from_config(model_config)).to(dtype).eval()
    cfg = load_config(None, ["model.target.kind=hf", f"model.target.path={directory}",
                             f"model.draft.target_layer_ids={list(layer_ids)}", f"objective.labels={labels}",
                             f"model.target.dtype={'bfloat16' if bf16 else 'float32'}", "transport.max_in_flight=1",
                             "transport.dtype=auto", f"plan.token_budget={seqs * seq_len}"])
    sc = Scaled(vocab=model_config.vocab_size, seqs=seqs, seq_len=seq_len)
    batch = _batch(sc)
    b = 2 if bf16 else 4
    precision = M.Precision(device="cpu", target_bytes=b, transfer_bytes=b, drafter_compute=b, attention="sdpa")
    worst = M.BatchShape(tokens=seqs * seq_len, seqs=seqs, anchors=0)
    terms = M.target_terms(model_shapes(cfg), precision, cfg, worst, ONE_RANK)

    def capture():
        return capture_for_drafter(target, batch, list(layer_ids), cfg.objective, dtype)

    held = capture()
    with LiveBytes() as live:
        live.track(*target.parameters(), *target.buffers(), *_packet_tensors(held), batch.input_ids,
                   batch.loss_mask, batch.cu_seqlens)
        before = live.now
        capture()
    return {"terms": terms, "measured": live.peak, "capture": live.peak - before,
            "weights": sum(p.numel() * p.element_size() for p in target.parameters())}


def _validate_report(v: dict) -> str:
    mib = lambda x: f"{x / 2**20:9.1f}"  # noqa: E731
    shape = v["shape"]
    kind = ("bf16 target, drafter under CPU bf16 autocast" if shape["bf16"] else "float32") \
        + f", objective.labels={shape['labels']}" + (", checkpointed layers" if shape["checkpoint_layers"] else "")
    lines = [f"validate on CPU ({kind}, sdpa attention): {v['shape']}", f"batch {v['batch']}",
             f"{'':28s} {'predicted MiB':>13s} {'measured MiB':>13s} {'pred/meas':>9s}"]
    rows = [("target peak", v["target"]["predicted"], v["target"]["measured"])]
    for name in ("chunked", "unchunked"):
        d = v[name]
        rows.append((f"drafter peak ({name})", d["predicted"], d["measured"]))
        if d["saved_measured"] is not None:
            rows.append((f"drafter saved ({name})", d["saved_predicted"], d["saved_measured"]))
    lines += [f"{n:28s} {mib(p):>13s} {mib(m):>13s} {p / m:9.3f}" for n, p, m in rows]
    if "saved_ratio" in v:
        lines.append(f"chunked / unchunked: peak saved bytes {v['saved_ratio']:.3f} (target <= 0.1)"
                     + (f", step time {v['time_ratio']:.2f} ({v['chunked']['step_s']:.2f} s vs "
                        f"{v['unchunked']['step_s']:.2f} s; target <= 1.3)" if "time_ratio" in v else ""))
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------------

def evaluate(cfg: Config, device_gib: float, target_shape: str | None = None,
             device: str = "cuda") -> tuple[M.Prediction, dict]:
    """The prediction at the worst batches of the config's real plan on a `device` ("cuda" or "cpu": its
    dtypes and attention path), and where they came from. ValueError for a target split train refuses."""
    shapes = model_shapes(cfg, target_shape)
    check_target_split(cfg, shapes)
    lengths, supervised, anchorable, source = M.plan_lengths(cfg)
    worst = M.worst_batches(cfg, lengths, supervised, anchorable)
    precision = M.Precision.from_config(cfg, device)
    pred = M.predict(cfg, shapes, list(worst.values()), device_gib, precision=precision)
    moe = (f", {shapes.experts} experts ({shapes.experts_per_token} per token) in {len(shapes.sparse_layers)} of "
           f"{shapes.layers} layers" if shapes.experts else "")
    dtype = {4: "float32", 2: "bf16"}[precision.target_bytes]
    drafter = "bf16 autocast" if precision.autocast else "float32"
    return pred, {"source": source, "target_shape": shapes.source,
                  "target_params": f"{shapes.target_params / 1e9:.2f}B parameters{moe}, "
                                   f"model.target.tensor_parallel={cfg.model.target.tensor_parallel}",
                  "precision": f"{device}: {dtype} target, drafter {drafter}, {precision.attention} attention",
                  "worst_batches": {k: w.summary() for k, w in worst.items()}}


def host_memory_gib() -> float:
    """This machine's physical memory: what a CPU run's ranks share."""
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / M.GiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_dist.bench.memory", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="the run's device: its dtypes (model.target.dtype=auto: bf16 on CUDA, float32 on CPU) and "
                         "attention path")
    ap.add_argument("--gpu-mem-gib", type=ranged(float, gt=0), default=None,
                    help="memory of one device (default: an H200's 141 GiB; with --device cpu this machine's memory)")
    ap.add_argument("--target-shape", choices=sorted(TARGET_SHAPES),
                    help="built-in target shape when model.target.path has no config.json")
    ap.add_argument("--json", help="write the prediction here")
    ap.add_argument("--validate", action="store_true",
                    help="also check the memory model against the real code on CPU, at built-in scaled shapes, and "
                         "the config's own target where it can be built here; a few minutes")
    args = ap.parse_args(argv)
    device_gib = args.gpu_mem_gib or (host_memory_gib() if args.device == "cpu" else 141.0)
    try:
        if args.json:  # before the prediction and --validate's minutes: a bad path is bad input, not a traceback
            check_output_path(args.json, "--json", make_parents=True)
        cfg = load_config(args.config, args.overrides)
        pred, info = evaluate(cfg, device_gib, args.target_shape, args.device)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    out.write(f"{args.config} {' '.join(args.overrides)}\ntarget shape: {info['target_shape']}\n"
              f"target: {info['target_params']}\nprecision: {info['precision']}\n"
              f"worst batches of {info['source']}: {info['worst_batches']}\n")
    out.write(M.gib_table(pred) + "\n")
    out.write(f"{args.device} device {pred.device_gib:.3g} GiB: {'fits' if pred.fits else 'does NOT fit'}; "
              f"objective.anchor_chunk={pred.anchor_chunk}, largest that fits: {pred.best_anchor_chunk}\n")
    for role in pred.roles:
        msg = M.preflight_message(pred, role)
        if msg:
            out.write(msg + "\n")
    if pred.unsure:
        out.write(f"unsure: {pred.unsure}\n")
    result = pred.to_json() | info
    if args.validate:
        result |= run_validation(out)
        result["validate_config_target"] = validate_config_target(cfg, model_shapes(cfg, args.target_shape), out)
    if args.json:
        write_json(Path(args.json), result, indent=2)
    return 0


MAX_VALIDATE_PARAMS = 1e9  # the config's own target is built on CPU (random weights, float32) only below this


def validate_config_target(cfg: Config, shapes, out) -> dict | None:
    """--validate on the config's own target, where it can be built here: a transformers model of its
    config.json (random weights, float32, below MAX_VALIDATE_PARAMS), its capture at the config's feature
    layers measured against the model (`validate_hf_capture`). Else a line saying why not, and None."""
    path = Path(cfg.model.target.path)
    why = ("it is the tiny target (the scaled shapes above are of its kind)" if cfg.model.target.kind != "hf" else
           f"{path / 'config.json'} is not here" if not (path / "config.json").is_file() else
           f"its {shapes.target_params / 1e9:.2f}B parameters are too many to build here"
           if shapes.target_params > MAX_VALIDATE_PARAMS else None)
    if why:
        out.write(f"the config's own target is not validated: {why}\n")
        return None
    from transformers import AutoConfig
    out.write(f"validating the config's own target ({path}, random weights, float32)...\n")
    out.flush()
    with tempfile.TemporaryDirectory() as tmp:
        v = validate_hf_capture(AutoConfig.from_pretrained(str(path), local_files_only=True), tmp,
                                list(shapes.feature_layers), labels=cfg.objective.labels)
    t = v["terms"]
    pred, peak = t["capture"] + t.get("distill", 0.0), sum(t.values())
    out.write(f"the config's target: capture predicted {pred / 2**20:.2f} MiB, measured {v['capture'] / 2**20:.2f} MiB "
              f"({pred / v['capture']:.3f}); peak predicted {peak / 2**20:.1f} MiB, measured "
              f"{v['measured'] / 2**20:.1f} MiB ({peak / v['measured']:.3f})\n")
    return {"capture_predicted": pred, "capture_measured": v["capture"], "peak_predicted": peak,
            "peak_measured": v["measured"]}


def run_validation(out) -> dict:
    """--validate: the memory model against the real code at built-in scaled shapes, each announced before
    it runs (together several minutes on a loaded 2-core machine)."""
    result: dict = {"validate": []}
    for sc in (Scaled(), Scaled(bf16=True)):
        out.write(f"validating at a built-in scaled shape, not the config's ({'bf16' if sc.bf16 else 'float32'}, "
                  f"hidden {sc.hidden}, {sc.seqs} x {sc.seq_len} tokens)...\n")
        out.flush()
        v = validate(sc, time_steps=not sc.bf16)
        out.write(_validate_report(v) + "\n")
        result["validate"].append({k: v[k] for k in v if k not in ("chunked", "unchunked")} | {
            k: {kk: vv for kk, vv in v[k].items() if kk != "terms"} for k in ("chunked", "unchunked")})
    out.write("validating a tiny transformers Qwen3-MoE target's capture...\n")
    out.flush()
    with tempfile.TemporaryDirectory() as tmp:
        v = validate_hf_capture(tiny_moe_config(), tmp, [0, 2], bf16=True)
    pred = v["terms"]["capture"]
    out.write(f"validate a tiny transformers Qwen3-MoE target (bf16, 16 experts, 4 per token): capture "
              f"predicted {pred / 2**20:.2f} MiB, measured {v['capture'] / 2**20:.2f} MiB "
              f"({pred / v['capture']:.3f}); weights {v['terms']['weights'] / v['weights']:.3f} of measured\n")
    result["validate_moe"] = {"capture_predicted": pred, "capture_measured": v["capture"]}
    return result


if __name__ == "__main__":
    sys.exit(main())
