"""bench.gpu_check's "grads" section: the GPU attention paths against the reference, on a small packed batch.

No test here can run them: flex attention has no backward on CPU (torch 2.13), and flash-attn is CUDA
only. So on the first GPU:
  drafter  one `step.drafter_step` (several anchor chunks, the context's gradient accumulated across them)
           on each block-attention path ("flex", "sdpa") against the "ref" path: the loss and every
           parameter's gradient, in float32 (TF32 off) and under bf16 autocast;
  target   `HFTarget.capture` of a small random transformers Qwen3 on each causal path ("flex", and
           "flash" where flash-attn imports, bf16 only) against "ref": the captured features.
Each comparison is the relative error |x - ref| / |ref| (Frobenius norms) of each tensor, the worst one
reported; above its dtype's tolerance (TOL) the section fails after writing every row. The dry run (CPU)
compares "sdpa" with "ref" for the drafter and eager flex with "ref" for the target's forward, and says
that flex's backward is left to CUDA.
"""
from __future__ import annotations

from dataclasses import replace

from dflash_dist.config import load_config

TOL = {"float32": 1e-3, "bfloat16": 5e-2}
LENGTHS = (320, 96, 513, 200)  # packed sequences: tile-unaligned, one shorter than a flex tile
PROMPT = 40  # each sequence's first tokens carry no loss
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2,
             head_dim=64)


def small_config(dry: bool):
    """A small Qwen3-shaped job: 2 draft layers, 24 anchors per sequence in chunks of 32, loss in 256 rows."""
    shape = [f"model.target.{k}={v}" for k, v in SMALL.items()]
    return load_config(None, shape + ["model.draft.num_layers=2", "model.draft.target_layer_ids=[1,3]",
                                      "objective.num_anchors=24", "objective.anchor_chunk=32",
                                      "objective.loss_rows=256"])


def rel_err(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def drafter_step_on(path: str, model, batch, settings):
    """(loss, {name: gradient}) of one drafter step (a `StepBatch`) on attention path `path`."""
    from dflash_dist.models import attention as attn
    from dflash_dist.training.step import drafter_step
    model.zero_grad(set_to_none=True)
    attn.backend.use(path)
    try:
        m = drafter_step(model, batch, settings)
    finally:
        attn.backend.use(None)
    loss = float(m.loss_sum) / float(m.weight_sum)
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(rep, label: str, got: dict, ref: dict, tol: float, bad: list) -> None:
    """One row: the worst relative error over `got`'s tensors against `ref`'s."""
    errs = {k: rel_err(got[k], ref[k]) for k in ref}
    worst = max(errs, key=errs.get)
    ok = errs[worst] <= tol
    rep.add(label, errs[worst], f"{'ok' if ok else 'MISMATCH'}: worst {worst} of {len(errs)}; tolerance {tol:g}")
    if not ok:
        bad.append(f"{label} {errs[worst]:.2e} ({worst})")


def check_drafter(rep, dry: bool, bad: list) -> None:
    import torch

    from dflash_dist.bench.gpu_setup import device, packed_batch, reference_drafter
    from dflash_dist.training.objective import draw_anchors
    from dflash_dist.training.step import StepBatch, step_settings
    dev, cfg = device(dry), small_config(dry)
    batch = packed_batch(LENGTHS, [L - PROMPT for L in LENGTHS], SMALL["vocab_size"], dev)
    anchors, anchor_cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, cfg.objective.num_anchors,
                                      torch.Generator().manual_seed(1))
    paths = ["sdpa"] + ([] if dry else ["flex"])
    if dry:
        rep.add("drafter flex", "skipped", "no flex backward on CPU: compared on CUDA only")
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).split(".")[-1]
        torch.manual_seed(0)
        _, model = reference_drafter(cfg, dev, torch.float32)  # trained in float32; bf16 under autocast
        g = torch.Generator(device=dev).manual_seed(2)
        feats = torch.randn(batch.num_tokens, 2 * SMALL["hidden_size"], device=dev, generator=g).to(dt)
        step_batch = StepBatch(batch, feats, None, anchors, anchor_cu)
        settings = replace(step_settings(cfg, model.spec, torch.bfloat16 if dt == torch.bfloat16 else None),
                           batch_mean=True)
        ref_loss, ref = drafter_step_on("ref", model, step_batch, settings)
        for path in paths:
            loss, grads = drafter_step_on(path, model, step_batch, settings)
            tol = TOL[name]
            ok = abs(loss - ref_loss) <= tol * abs(ref_loss)
            rep.add(f"drafter {name} {path} loss", loss, f"{'ok' if ok else 'MISMATCH'}: ref {ref_loss:.6g}")
            if not ok:
                bad.append(f"drafter {name} {path} loss {loss:.6g} vs {ref_loss:.6g}")
            compare(rep, f"drafter {name} {path} grads", grads, ref, tol, bad)


def check_target(rep, dry: bool, bad: list) -> None:
    import torch
    from transformers import Qwen3Config

    from dflash_dist.bench.gpu_setup import device
    from dflash_dist.models import attention as attn
    dev = device(dry)
    s = SMALL
    hf_cfg = Qwen3Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                         num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                         num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"], tie_word_embeddings=False)
    cu = torch.tensor((0,) + LENGTHS, device=dev).cumsum(0)
    ids = torch.randint(0, s["vocab_size"], (int(cu[-1]),), generator=torch.Generator().manual_seed(3)).to(dev)
    layer_ids = [1, 3, 5]
    # flex compiled on CPU takes minutes; eager flex runs the same mask and kernel maths
    before, attn.backend.compile_flex = attn.backend.compile_flex, not dry
    try:
        _compare_capture(rep, dry, bad, hf_cfg, dev, ids, cu, layer_ids)
    finally:
        attn.backend.compile_flex = before


def _compare_capture(rep, dry: bool, bad: list, hf_cfg, dev, ids, cu, layer_ids) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_dist.data.collate import position_ids
    from dflash_dist.models import attention as attn
    from dflash_dist.models.hf_target import HFTarget, _dtype_kwarg
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).split(".")[-1]
        torch.manual_seed(0)
        with torch.device(dev):
            target = HFTarget(AutoModelForCausalLM.from_config(hf_cfg, **{_dtype_kwarg(): dt}))
        feats = {}
        paths = ["ref", "flex"] + (["flash"] if not dry and dt != torch.float32 and attn.flash_available() else [])
        for path in paths:
            attn.backend.use(path)
            try:
                feats[path] = target.capture(ids, cu, position_ids(cu), layer_ids)[0]
            finally:
                attn.backend.use(None)
        for path in paths[1:]:
            compare(rep, f"target {name} {path} features" + (" (eager)" if dry else ""), {"features": feats[path]},
                    {"features": feats["ref"]}, TOL[name], bad)


def section_grads(rep, dry: bool, deadline: float) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 compares float32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    if dry:  # tiny ops on a shared CPU: intra-op threads only add synchronisation
        torch.set_num_threads(1)
    bad: list[str] = []
    check_drafter(rep, dry, bad)
    check_target(rep, dry, bad)
    if bad:
        raise AssertionError("attention paths disagree with the reference: " + "; ".join(bad))
