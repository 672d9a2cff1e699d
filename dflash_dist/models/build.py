"""Build the frozen target and the drafter's spec from the config, with the checks that need the target."""
from __future__ import annotations

import torch

from dflash_dist.config import Config, ConfigError, default_target_layer_ids
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec
from dflash_dist.models.qwen3 import TinyQwen3
from dflash_dist.models.variants import check_objective, options_of, variant_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def build_target(cfg: Config, device: torch.device, head_only: bool = False, tp_group=None):
    """The frozen target. Targets run it; drafters borrow its embed_tokens/lm_head, and with
    `head_only` (a transformers target) read nothing else of it, straight to their device. `tp_group`:
    the ranks of this target replica, which load it sharded together (tensor parallelism)."""
    tc = cfg.model.target
    dtype = compute_dtype(tc.dtype, device)
    if tc.kind == "tiny":
        model = TinyQwen3(tc)
    elif head_only:
        from dflash_dist.models.head import load_head_only_target
        return load_head_only_target(tc.path, dtype, device)
    else:
        from dflash_dist.models.hf_target import load_hf_target  # optional extra: transformers
        model = load_hf_target(tc.path, dtype=dtype, device=device, tp_group=tp_group)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def draft_spec(cfg: Config, target) -> DraftSpec:
    check_objective(cfg)
    d, L = cfg.model.draft, target.num_layers
    ids = list(d.target_layer_ids) or default_target_layer_ids(L, d.num_feature_layers)
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise ConfigError(f"config key 'model.draft.target_layer_ids': {bad} outside the target's layers [0, {L - 1}]")
    if L - 1 in ids:
        # transformers returns the last layer's state after the final norm (hidden_states[L]), so the
        # z-lab convention is ambiguous there; the DFlash rule never picks it.
        raise ConfigError(f"config key 'model.draft.target_layer_ids': layer {L - 1} is the target's last layer; "
                          f"use ids up to {L - 2}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        # SGLang and vLLM capture and concatenate features in ascending layer order, whatever order the
        # config lists: a drafter trained on another order is served permuted inputs, without any error.
        raise ConfigError(f"config key 'model.draft.target_layer_ids': {ids} must be strictly increasing "
                          "(unique, ascending: the order the serving engines concatenate features in)")
    mask = d.mask_token_id
    if mask < 0:  # the tokenizer's mask token or first unused row (hf); the last row (tiny target)
        mask = getattr(target, "default_mask_token_id", None)
        mask = target.vocab_size - 1 if mask is None else mask
    if not 0 <= mask < target.vocab_size:
        raise ConfigError(f"config key 'model.draft.mask_token_id': {mask} outside the vocabulary [0, {target.vocab_size})")
    heads = d.num_heads or target.num_heads
    kv = d.num_kv_heads or target.num_kv_heads
    if heads % kv:
        raise ConfigError(f"config key 'model.draft.num_kv_heads': {kv} does not divide num_heads {heads}")
    variant = variant_of(d.variant)
    options = variant.model_options(options_of(cfg))
    variant.check(options, target)
    backbone = dict(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=d.intermediate_size or target.intermediate_size, num_layers=d.num_layers,
        num_heads=heads, num_kv_heads=kv, head_dim=d.head_dim or target.head_dim,
        rope_theta=target.rope_theta, rms_eps=target.rms_eps, block_size=cfg.objective.block_size,
        mask_token_id=mask, target_layer_ids=tuple(ids), num_target_layers=L,
        max_position_embeddings=target.max_position_embeddings, variant=d.variant)
    return DraftSpec(**backbone, options=options)


def build_drafter(spec: DraftSpec, target, seed: int, device: torch.device,
                  checkpoint_layers: bool = False) -> DFlashDrafter:
    """Seeded, so every drafter rank starts from the same weights (drafter 0 also broadcasts them)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDrafter(spec, checkpoint_layers=checkpoint_layers)
    model = model.to(device)  # trained in float32; bf16 autocast on CUDA
    model.attach_target_head(target.embed_tokens, target.lm_head)
    return model
