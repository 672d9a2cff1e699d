"""The export and the target it is evaluated against, with every defect named by file (exit 2)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dflash_dist.evaluation.prompts import EvalInputError

_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "block_size", "num_target_layers")


def read_export_config(draft_dir: str | Path) -> dict:
    """config.json of a z-lab-format export, checked for what the drafter and vLLM read from it."""
    path = Path(draft_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise EvalInputError(f"--draft {draft_dir}: no config.json (an export directory of dflash_dist.models.export)") from exc
    except (OSError, ValueError) as exc:
        raise EvalInputError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise EvalInputError(f"{path}: expected a JSON object")
    missing = [k for k in _KEYS if k not in cfg]
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict) or not {"mask_token_id", "target_layer_ids"} <= dc.keys():
        missing.append("dflash_config {mask_token_id, target_layer_ids}")
    if isinstance(dc, dict):
        from dflash_dist.models.variants import variant_of_export
        v = variant_of_export(cfg)
        missing += [f"dflash_config.{k} ({v.architecture})" for k in v.config_keys if k not in dc]
    if missing:
        raise EvalInputError(f"{path}: missing {', '.join(missing)} (not a DFlash export)")
    return cfg


def load_drafter_checked(draft_dir: str | Path, dtype: torch.dtype = torch.float32):
    from safetensors import SafetensorError

    from dflash_dist.models.export import load_drafter
    read_export_config(draft_dir)
    weights = Path(draft_dir) / "model.safetensors"
    if not weights.is_file():
        raise EvalInputError(f"{weights}: missing")
    try:
        return load_drafter(Path(draft_dir), dtype)
    except (SafetensorError, OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
        # A truncated or foreign file: safetensors' header error, or load_state_dict's missing/unexpected keys.
        raise EvalInputError(f"{weights}: cannot load the drafter weights ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def check_fit(export: dict, vocab_size: int, hidden_size: int, num_layers: int, draft_dir) -> None:
    """The export (its config.json) against the target it is evaluated against, before any decoder or
    engine starts: both engines call it with the target's own numbers."""
    dc = export["dflash_config"]
    want = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_target_layers": num_layers}
    bad = {k: (export[k], v) for k, v in want.items() if export[k] != v}
    if bad:
        raise EvalInputError(f"drafter {draft_dir} does not fit the target: " +
                             ", ".join(f"{k} {a} (drafter) != {b} (target)" for k, (a, b) in bad.items()))
    mask, ids = dc["mask_token_id"], list(dc["target_layer_ids"])
    if not 0 <= mask < vocab_size or max(ids) >= num_layers - 1:
        raise EvalInputError(f"{Path(draft_dir) / 'config.json'}: dflash_config {{mask_token_id {mask}, "
                             f"target_layer_ids {ids}}} outside the target's vocabulary or layers")


def load_for_eval(draft_dir: str | Path, cfg, device: torch.device):
    """(target, drafter) ready to decode: the export must fit the target it is evaluated against."""
    from dflash_dist.models.build import build_target
    drafter = load_drafter_checked(draft_dir)
    target = build_target(cfg, device)
    check_fit(read_export_config(draft_dir), target.vocab_size, target.hidden_size, target.num_layers, draft_dir)
    drafter = drafter.to(device=device, dtype=target.embed_tokens.weight.dtype).eval()
    drafter.attach_target_head(target.embed_tokens, target.lm_head)
    return target, drafter


# The config keys that fix a drafter's shapes, by the DraftSpec field an export fixes them in. 0 or -1 of
# a size or the mask token means "the target's" (draft_spec), never a contradiction.
_SPEC_KEYS = {"model.draft.variant": "variant", "objective.block_size": "block_size",
              "model.draft.num_layers": "num_layers", "model.draft.target_layer_ids": "target_layer_ids",
              "model.draft.mask_token_id": "mask_token_id", "model.draft.intermediate_size": "intermediate_size",
              "model.draft.num_heads": "num_heads", "model.draft.num_kv_heads": "num_kv_heads",
              "model.draft.head_dim": "head_dim"}
_UNSET = (0, -1, [], ())


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def check_config_agrees(export: dict, cfg, overrides: list[str], draft_dir) -> None:
    """The drafter's shapes come from the export: a key the user set (on the command line, or in a config
    file away from the schema default) to another value than the export's would be silently ignored, and
    the figures taken for a drafter other than the one the user named (a variant, a block size)."""
    from dflash_dist.config import load_config
    from dflash_dist.models.export import spec_from_export
    spec, default = spec_from_export(export), load_config()
    named = {item.split("=", 1)[0].lstrip("+~") for item in overrides or []}
    bad = []
    for key, field in _SPEC_KEYS.items():
        mine, theirs = _get(cfg, key), getattr(spec, field)
        explicit = key in named or mine != _get(default, key)
        if explicit and mine not in _UNSET and _as_list(mine) != _as_list(theirs):
            bad.append(f"{key}={mine} (the export's {theirs})")
    if cfg.model.draft.variant == spec.variant:  # the config's `variant` section holds this variant's options
        defaults = spec.family.Options()
        for f in dataclasses.fields(spec.options):
            mine, theirs = getattr(cfg.variant, f.name), getattr(spec.options, f.name)
            explicit = f"variant.{f.name}" in named or mine != getattr(defaults, f.name)
            if explicit and mine != theirs:
                bad.append(f"variant.{f.name}={mine} (the export's {theirs})")
    if bad:
        raise EvalInputError(f"--draft {draft_dir}: the export fixes the drafter, and these settings contradict it: "
                             f"{', '.join(bad)}; drop them (the export's values are used) or pass the export "
                             "they describe")
