"""What a drafter rank needs of a transformers target: its embedding, its LM head and its shapes.

A drafter trains on features the target ranks send; of the target itself it uses only `embed_tokens`
(the block's input) and `lm_head` (the loss), both frozen. `load_hf_head` reads just those two tensors
from the checkpoint's safetensors files, straight to the rank's device (safetensors maps the file and
copies each tensor once to where it is asked for), so a drafter never holds the decoder layers: for
Qwen3-8B that is 2.3 GiB in bf16 instead of 16 GiB, and no host copy of the whole model.

Tensor names are those of transformers' Llama-family causal LMs (Qwen3, Llama, Mistral):
`model.embed_tokens.weight` and `lm_head.weight`. With `tie_word_embeddings` the head is the embedding
(its checkpoint has no `lm_head.weight`). Any other layout is refused with the file that lacks the tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def read_config(path: str | Path) -> dict:
    """config.json of a transformers model directory, as a dict; FileNotFoundError naming the path."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"model.target.path={path}: no config.json (a local model directory is required)")
    return json.loads(f.read_text())


def context_length(value) -> int:
    """A target's max_position_embeddings; a config without one gets a Qwen3's (40960)."""
    return int(value) if value else 40960


def shape_facts(cfg: dict, where: str = "config.json") -> dict:
    """The facts a drafter (and the memory model) needs from a Llama-family config.json."""
    def need(key: str):
        if key not in cfg:
            raise ValueError(f"{where}: no '{key}' (not a Llama-family causal LM config)")
        return cfg[key]
    heads = int(need("num_attention_heads"))
    facts = dict(vocab_size=int(need("vocab_size")), hidden_size=int(need("hidden_size")),
                 num_layers=int(need("num_hidden_layers")), num_heads=heads,
                 num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                 head_dim=int(cfg.get("head_dim") or need("hidden_size") // heads),
                 intermediate_size=int(need("intermediate_size")),
                 rms_eps=float(cfg.get("rms_norm_eps", 1e-6)), tied=bool(cfg.get("tie_word_embeddings", False)),
                 max_position_embeddings=context_length(cfg.get("max_position_embeddings")))
    # transformers 5 keeps rope_theta in rope_parameters; 4.x at the top level.
    rope = cfg.get("rope_parameters")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = cfg.get("rope_theta") if theta is None else theta
    if theta is None:
        raise ValueError(f"{where}: no rope_theta (neither at the top level nor in rope_parameters)")
    return facts | {"rope_theta": float(theta)} | moe_facts(cfg, facts["num_layers"], facts["intermediate_size"], where)


def moe_facts(cfg: dict, num_layers: int, intermediate_size: int, where: str = "config.json") -> dict:
    """A mixture-of-experts config's routing facts ({} for a dense one): num_experts, experts_per_token,
    moe_intermediate_size (one expert's MLP width) and sparse_layers (the layer ids whose MLP is the
    experts). Keys as transformers names them: Qwen3-MoE (`num_experts`, `moe_intermediate_size`, a layer
    i is sparse when i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0) and Mixtral
    (`num_local_experts`, experts of `intermediate_size`, every layer sparse). transformers 5 writes a
    Qwen3-MoE config's `num_experts` as `num_local_experts` (its attribute map)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    if not cfg.get("num_experts_per_tok"):
        raise ValueError(f"{where}: {experts} experts but no 'num_experts_per_tok'")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate_size),
                sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the shard index or the single file."""
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        return {name: path / f for name, f in weight_map.items()}
    if (path / SINGLE).is_file():
        from safetensors import safe_open
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: path / SINGLE for name in f.keys()}
    raise FileNotFoundError(f"model.target.path={path}: neither {INDEX} nor {SINGLE}")


def load_hf_head(path: str | Path, dtype: torch.dtype, device: torch.device | str
                 ) -> tuple[nn.Embedding, nn.Linear, dict]:
    """(embed_tokens, lm_head, info): the two frozen modules in `dtype` on `device` (the same tensor when
    tied) and info = {"files": files read, "tensors": names read, "bytes": bytes loaded, "tied": bool}."""
    from safetensors import safe_open
    path = Path(path)
    facts = shape_facts(read_config(path), str(path / "config.json"))
    files = _tensor_files(path)
    names = [EMBED] if facts["tied"] else [EMBED, HEAD]
    where = path / INDEX if (path / INDEX).is_file() else path / SINGLE
    for name in names:
        if name not in files:
            hint = "" if name != HEAD else " (and config.json does not set tie_word_embeddings)"
            raise KeyError(f"{where}: no tensor '{name}'{hint}")
    loaded = {}
    for name in names:
        with safe_open(str(files[name]), framework="pt", device=str(device)) as f:
            loaded[name] = f.get_tensor(name).to(dtype)
    emb = loaded[EMBED]
    want = (facts["vocab_size"], facts["hidden_size"])
    for name, t in loaded.items():
        if tuple(t.shape) != want:
            raise ValueError(f"{files[name]}: '{name}' has shape {tuple(t.shape)}, config.json says {want}")
    embed = nn.Embedding(*want, _weight=emb, _freeze=True)  # takes the loaded tensor as is
    head = nn.Linear(want[1], want[0], bias=False, device="meta")
    head.weight = embed.weight if facts["tied"] else nn.Parameter(loaded[HEAD], requires_grad=False)
    info = {"files": sorted({str(files[n]) for n in names}), "tensors": names, "tied": facts["tied"],
            "bytes": sum(t.numel() * t.element_size() for t in loaded.values())}
    return embed, head, info


class HeadOnlyTarget(nn.Module):
    """The attributes of the target adapters (TinyQwen3, HFTarget) that a drafter uses, without the
    decoder: shapes, the frozen `embed_tokens` and `lm_head`, and `default_mask_token_id` (`TargetShapes`)."""
    kind = "head"

    def __init__(self, facts: dict, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 default_mask_token_id: int | None = None, info: dict | None = None):
        super().__init__()
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "rope_theta", "rms_eps", "max_position_embeddings"):
            setattr(self, key, facts[key])
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self.default_mask_token_id = default_mask_token_id
        self.info = info or {}
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()


def default_mask_token_id(path: Path, vocab_size: int) -> int | None:
    """The id the drafter's masked block slots hold, chosen deliberately (docs/serving.md) and logged: the
    tokenizer's mask token if it has one; else the first embedding row no token uses (models pad their
    vocabulary: Qwen3 has ~270 unused rows); else a spare control token (`spare_special_token`). None when
    there is no tokenizer or none of these exists (then model.draft.mask_token_id, or the last row)."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None  # (AutoTokenizer would build an empty tokenizer from config.json alone)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # no tokenizer files: the user must give model.draft.mask_token_id
        log.info("no tokenizer in %s (%s): mask token id must come from the config", path, type(exc).__name__)
        return None
    if tok.mask_token_id is not None and tok.mask_token_id < vocab_size:
        mask, why = int(tok.mask_token_id), "the tokenizer's mask token"
    elif len(tok) < vocab_size:
        mask, why = len(tok), "the first embedding row no token uses"
    else:
        mask = spare_special_token(tok, vocab_size)
        why = "a spare control token, which the chat template never writes (no mask token, no unused row)"
    if mask is None:
        log.warning("%s: no mask token, no unused embedding row and no spare control token: the mask is the last "
                    "row (%d), a real token; give model.draft.mask_token_id to choose another", path, vocab_size - 1)
        return None
    log.info("mask token id %d (%r): %s", mask, tok.convert_ids_to_tokens(mask), why)
    return mask


def spare_special_token(tok, vocab_size: int) -> int | None:
    """The highest-id special added token that is none of bos/eos/pad/unk and that the chat template never
    writes (SmolLM2: `<empty_output>`, id 16): unlike the last row (SmolLM2's `'ectable'`, a word piece of
    ordinary text), only its literal string in a text yields it, so a masked slot is all but never also a
    real token of the prompt or the answer."""
    named = {t for t in (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) if t}
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    spare = [i for i, t in tok.added_tokens_decoder.items()
             if t.special and i < vocab_size and t.content not in named and t.content not in template]
    return max(spare) if spare else None


def load_head_only_target(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> HeadOnlyTarget:
    """A drafter rank's stand-in for `load_hf_target`: config facts, embedding and LM head only."""
    path = Path(path)
    facts = shape_facts(read_config(path), str(path / "config.json"))
    embed, head, info = load_hf_head(path, dtype, device)
    log.info("drafter head from %s: %s (%.2f GiB, %s) on %s", path, ", ".join(info["tensors"]),
             info["bytes"] / 2**30, "tied" if info["tied"] else "untied", device)
    return HeadOnlyTarget(facts, embed, head, default_mask_token_id(path, facts["vocab_size"]), info)
