"""Export the drafter in the z-lab DFlash format, read by vLLM/SGLang DFlash support.

config.json: a Qwen3 config of the drafter plus block_size, num_target_layers and
dflash_config {mask_token_id, target_layer_ids}; model.safetensors: layers.*, fc.weight,
hidden_norm.weight, norm.weight only (the embedding and LM head are the target's).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_dist.models.drafter import DFlashDrafter, DraftSpec


def export_config(spec: DraftSpec) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 40960,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * spec.num_layers,
        "torch_dtype": "bfloat16",
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)},
    }


def export_drafter(spec: DraftSpec, state: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the drafter `state` (a whole state dict) to out_dir atomically (a temporary directory
    renamed into place)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = export_config(spec)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def spec_from_export(cfg: dict) -> DraftSpec:
    dc = cfg["dflash_config"]
    return DraftSpec(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rope_theta=cfg["rope_theta"],
        rms_eps=cfg["rms_norm_eps"], block_size=cfg["block_size"], mask_token_id=dc["mask_token_id"],
        target_layer_ids=tuple(dc["target_layer_ids"]), num_target_layers=cfg["num_target_layers"])


def load_drafter(path: Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Reads an export back (without the target's embedding/LM head: attach them to run it)."""
    path = Path(path)
    spec = spec_from_export(json.loads((path / "config.json").read_text()))
    model = DFlashDrafter(spec)
    state = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype)
