"""z-lab export of the drafter: files, tensor names, config fields, exact round trip, transformers config."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_dist.config import load_config
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.export import export_drafter, load_drafter

CPU = torch.device("cpu")

LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "post_attention_layernorm.weight"}


@pytest.fixture(scope="module")
def parts():
    cfg = load_config(overrides=["model.draft.num_layers=2", "objective.block_size=8"])
    target = build_target(cfg, CPU)
    spec = draft_spec(cfg, target)
    drafter = build_drafter(spec, target, seed=5, device=CPU)
    with torch.no_grad():  # norms start at 1: perturb them so the round trip checks them too
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return cfg, target, spec, drafter


def batch(target, spec):
    gen = torch.Generator().manual_seed(4)
    lengths = [30, 17]
    ids = torch.randint(0, 127, (sum(lengths),), generator=gen)
    cu = torch.tensor([0, 30, 47])
    pos = torch.cat([torch.arange(n) for n in lengths])
    feats, _ = target.capture(ids, cu, pos, list(spec.target_layer_ids))
    anchors, anchor_cu = torch.tensor([3, 10, 21, 30 + 2, 30 + 9]), torch.tensor([0, 3, 5])
    return feats, ids, cu, pos, anchors, anchor_cu


def test_files_keys_and_config(parts, tmp_path):
    _, target, spec, drafter = parts
    out = export_drafter(drafter.spec, drafter.state_dict(), tmp_path / "draft", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(spec.num_layers) for k in LAYER_KEYS}
    assert set(tensors) == expected
    H, n = spec.hidden_size, len(spec.target_layer_ids)
    assert tensors["fc.weight"].shape == (H, n * H)
    assert tensors["layers.1.self_attn.q_norm.weight"].shape == (spec.head_dim,)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == target.num_layers
    assert cfg["dflash_config"] == {"mask_token_id": spec.mask_token_id,
                                    "target_layer_ids": list(spec.target_layer_ids)}
    assert cfg["tie_word_embeddings"] is False and cfg["num_hidden_layers"] == 2
    assert cfg["torch_dtype"] == "float32" and cfg["vocab_size"] == target.vocab_size
    assert cfg["max_position_embeddings"] == target.max_position_embeddings


def test_the_export_carries_the_targets_context_and_a_card_that_says_how_to_serve_it(parts, tmp_path):
    _, target, spec, drafter = parts
    from dataclasses import replace
    long = replace(spec, max_position_embeddings=131072)  # e.g. a Llama-3.3-70B target
    facts = {"target": "/models/Llama-3.3-70B", "data": {"samples": 902000, "epochs": 6}, "tau": 6.5}
    out = export_drafter(long, drafter.state_dict(), tmp_path / "draft", facts=facts)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 131072
    assert load_drafter(out).spec.max_position_embeddings == 131072
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 7' in card  # B - 1, B = 8
    assert "vllm serve /models/Llama-3.3-70B --speculative-config" in card
    assert ("--speculative-algorithm DFLASH --speculative-draft-model-path EXPORT_DIR "
            "--speculative-dflash-block-size 8") in card
    for fact in ("/models/Llama-3.3-70B", "context 131072", f"mask token id | {spec.mask_token_id}",
                 f"{list(spec.target_layer_ids)}", "samples 902,000", "| tau at the end of training | 6.500 |"):
        assert fact in card, fact


def test_layer_ids_must_be_strictly_increasing_and_inside_the_target():
    from dflash_dist.config import ConfigError
    target = build_target(load_config(), CPU)  # 6 layers: ids 0..4
    for ids, why in (("[3,1,2]", "strictly increasing"), ("[1,1,2]", "strictly increasing"),
                     ("[1,2,9]", "outside the target's layers"), ("[-1,2]", "outside the target's layers"),
                     ("[1,5]", "the target's last layer")):
        with pytest.raises(ConfigError, match="model.draft.target_layer_ids") as e:
            draft_spec(load_config(overrides=[f"model.draft.target_layer_ids={ids}"]), target)
        assert why in str(e.value), (ids, str(e.value))
    assert draft_spec(load_config(overrides=["model.draft.target_layer_ids=[0,2,4]"]), target).target_layer_ids == (0, 2, 4)


def test_the_default_layer_ids_round_as_the_engines_do():
    from dflash_dist.config import default_target_layer_ids
    assert default_target_layer_ids(94, 5) == [1, 24, 46, 68, 91]  # half to even: 68.5 -> 68
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(80, 5) == [1, 20, 39, 58, 77]
    assert default_target_layer_ids(36, 1) == [18]


def test_round_trip_reproduces_logits_exactly(parts, tmp_path):
    _, target, spec, drafter = parts
    export_drafter(drafter.spec, drafter.state_dict(), tmp_path / "draft", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "draft")
    assert loaded.spec == spec
    loaded.attach_target_head(target.embed_tokens, target.lm_head)
    args = batch(target, spec)
    with torch.no_grad():
        assert torch.equal(loaded.block_logits(*args), drafter.block_logits(*args))
    # Exporting again replaces the directory whole.
    export_drafter(drafter.spec, drafter.state_dict(), tmp_path / "draft", dtype=torch.bfloat16)
    assert load_file(str(tmp_path / "draft" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not (tmp_path / "draft.tmp").exists()


def test_config_and_layers_load_in_transformers(parts, tmp_path):
    import transformers
    _, _, spec, drafter = parts
    out = export_drafter(drafter.spec, drafter.state_dict(), tmp_path / "draft", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    qcfg = transformers.Qwen3Config(**cfg)
    auto = transformers.AutoConfig.from_pretrained(str(out), local_files_only=True)
    for c in (qcfg, auto):
        assert isinstance(c, transformers.Qwen3Config)
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
            spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        assert c.dflash_config["target_layer_ids"] == list(spec.target_layer_ids) and c.block_size == 8
    # Every exported layer loads strictly into transformers' own Qwen3 decoder layer.
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
    tensors = load_file(str(out / "model.safetensors"))
    for i in range(spec.num_layers):
        layer = Qwen3DecoderLayer(qcfg, i)
        prefix = f"layers.{i}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
