"""Export the drafter in the z-lab DFlash format, read by vLLM/SGLang DFlash support.

config.json: a Qwen3 config of the drafter plus block_size, num_target_layers and
dflash_config {mask_token_id, target_layer_ids}, with the target's max_position_embeddings;
model.safetensors: layers.*, fc.weight, hidden_norm.weight, norm.weight only (the embedding and LM head
are the target's; DFlash 2 adds `layers.N.{attention_conv,mlp_conv}.*` and `candidate_selector.*`, the
architecture DFlash2DraftModel and its dflash_config keys, as z-lab's dflash2 fixture has them; DSpark
adds `markov_head.*` and `confidence_head.*` (float32), the architecture Qwen3DSparkModel and its
top-level keys, vLLM 0.32's qwen3_dspark.py contract; Domino adds `prefix_gru.*` and `embed_proj.*` under
DFlashDraftModel with dflash_config.projector_type "domino", SGLang's contract); README.md: a model card saying what it was trained against and on, its tau, and the
exact settings that serve it in SGLang and vLLM (docs/serving.md says why each matters).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_dist.io.files import AtomicDir, atomic_write
from dflash_dist.io.write_errors import os_errors
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec
from dflash_dist.models.variants import variant_of_export


def export_config(spec: DraftSpec) -> dict:
    """The backbone's config with the variant's fields: its architecture picks the engines' model class
    (vLLM's DFlash2Qwen3ForCausalLM and its DFlash2 speculator for `DFlash2DraftModel`)."""
    variant, cfg = spec.family, _base_config(spec)
    cfg["architectures"] = [variant.architecture]
    extra = dict(variant.config_fields(spec))
    cfg["dflash_config"].update(extra.pop("dflash_config", {}))
    cfg.update(extra)
    return cfg


def _base_config(spec: DraftSpec) -> dict:
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
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * spec.num_layers,
        "torch_dtype": "bfloat16",
        "block_size": spec.block_size,
        "num_target_layers": spec.num_target_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)},
    }


def serving_settings(spec: DraftSpec, draft: str = "EXPORT_DIR", target: str = "TARGET") -> dict:
    """What each engine must be told to serve this drafter as it was trained. vLLM drafts
    `num_speculative_tokens` mask slots after the bonus token and does not read block_size, so it must be
    B - 1, given explicitly (a wrong value silently serves another block); it infers the method only from
    "dflash" in the draft's path. SGLang reads block_size from config.json."""
    k = spec.family.drafts(spec.block_size)
    vllm_spec = {"method": spec.family.vllm_method, "model": draft, "num_speculative_tokens": k}
    return {
        # None: vLLM cannot serve this variant (Domino: no projector in vLLM 0.32's DFlash model).
        "vllm": None if spec.family.vllm_method is None else {
            "speculative_config": vllm_spec,
            "command": f"vllm serve {target} --speculative-config '{json.dumps(vllm_spec)}'"},
        "sglang": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": draft,
                   "speculative_dflash_block_size": spec.block_size,
                   "command": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                              f"--speculative-draft-model-path {draft} --speculative-dflash-block-size {spec.block_size}"},
    }


def model_card(spec: DraftSpec, facts: dict | None = None) -> str:
    """README.md of an export. `facts`: target (a path or name), data (samples, tokens, epochs, steps),
    tau (the end-of-training measurement) and tau_set (its prompt set), as far as known."""
    facts = facts or {}
    target = facts.get("target") or "TARGET"
    serve = serving_settings(spec, "EXPORT_DIR", target)
    k = spec.family.drafts(spec.block_size)
    data = facts.get("data") or {}
    tau = facts.get("tau")
    rows = [("target", f"`{target}`: {spec.num_target_layers} layers, hidden size {spec.hidden_size}, "
                       f"vocabulary {spec.vocab_size}, context {spec.max_position_embeddings}"),
            ("block size", f"{spec.block_size} (the bonus token + {spec.block_size - 1} drafted)" if k == spec.block_size - 1
                           else f"{spec.block_size} (the bonus token first; every slot drafts the next token: {k} drafted)"),
            ("mask token id", str(spec.mask_token_id)),
            ("target layer ids", f"{list(spec.target_layer_ids)} (ascending, as the engines concatenate them)"),
            ("drafter", f"{spec.num_layers} layers, {spec.num_heads} / {spec.num_kv_heads} heads x {spec.head_dim}")]
    if data:
        rows.append(("data", ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in data.items())))
    on = f" on {facts['tau_set']}" if facts.get("tau_set") else ""  # the prompt set it was measured on
    rows.append(("tau at the end of training", f"{tau:.3f}{on}" if isinstance(tau, (int, float)) else "not measured"))
    rows += spec.family.card_rows(spec)
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    v, s, notes = serve["vllm"], serve["sglang"], spec.family.card_notes()
    vllm = f"""## vLLM
{notes.get("vllm", "")}""" if v is None else f"""## Serve it with vLLM

`num_speculative_tokens` must be {k} ({"block size - 1" if k == spec.block_size - 1 else "the block size"}): vLLM does not read `block_size`.{notes.get("vllm", "")}

```bash
{v["command"]}
```

```python
from vllm import LLM
llm = LLM(model="{target}", speculative_config={json.dumps(v["speculative_config"])})
```"""
    return f"""# {spec.family.title} drafter (dflash_dist export)

A block-diffusion speculative-decoding drafter in the z-lab DFlash format (`config.json`,
`model.safetensors`: decoder layers, `fc`, `hidden_norm`, `norm`; the embedding and LM head are the
target's). Replace EXPORT_DIR by this directory's path.

| | |
|---|---|
{table}

{vllm}

## Serve it with SGLang

SGLang reads the block size ({spec.block_size}) from `config.json`; the flag below only makes it explicit.{notes.get("sglang", "")}

```bash
{s["command"]}
```
"""


def write_model_card(out_dir: Path, spec: DraftSpec, facts: dict | None = None) -> Path:
    return atomic_write(Path(out_dir) / "README.md", model_card(spec, facts))


def export_drafter(spec: DraftSpec, state: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                   facts: dict | None = None) -> Path:
    """Writes the drafter `state` (a whole state dict) and its model card (`facts`: see `model_card`) to
    out_dir atomically (a temporary directory renamed into place)."""
    cfg = export_config(spec)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    keep = spec.family.float32_prefixes  # tensors the engine holds in float32 (DSpark's confidence head)
    tensors = {k: v.detach().to("cpu", torch.float32 if k.startswith(keep) else dtype).contiguous()
               for k, v in state.items()}
    with AtomicDir(out_dir, replace=True) as d:
        (d.tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        with os_errors():  # safetensors' own error for a full disk: the OSError the callers handle
            save_file(tensors, str(d.tmp / "model.safetensors"), metadata={"format": "pt"})
        (d.tmp / "README.md").write_text(model_card(spec, facts))
    return Path(out_dir)


def spec_from_export(cfg: dict) -> DraftSpec:
    dc = cfg["dflash_config"]
    return DraftSpec(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rope_theta=cfg["rope_theta"],
        rms_eps=cfg["rms_norm_eps"], block_size=cfg["block_size"], mask_token_id=dc["mask_token_id"],
        target_layer_ids=tuple(dc["target_layer_ids"]), num_target_layers=cfg["num_target_layers"],
        max_position_embeddings=cfg.get("max_position_embeddings", 40960), **_variant_fields(cfg))


def _variant_fields(cfg: dict) -> dict:
    return variant_of_export(cfg).spec_fields(cfg)


def load_drafter(path: Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Reads an export back (without the target's embedding/LM head: attach them to run it)."""
    path = Path(path)
    spec = spec_from_export(json.loads((path / "config.json").read_text()))
    model = DFlashDrafter(spec)
    state = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype)
