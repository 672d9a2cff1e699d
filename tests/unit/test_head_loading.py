"""Drafters load only the embedding and the LM head of a transformers target, from single or sharded files."""
from __future__ import annotations

import json

import pytest
import safetensors
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_dist.config import load_config
from dflash_dist.models import head as head_mod
from dflash_dist.models.build import draft_spec
from dflash_dist.models.head import load_head_only_target, load_hf_head
from dflash_dist.models.hf_target import load_hf_target

SHAPE = dict(vocab_size=211, hidden_size=32, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rope_theta=5e5, rms_norm_eps=1e-5)
VARIANTS = {"single": (False, None), "sharded": (False, "20KB"), "tied": (True, None), "tied_sharded": (True, "20KB")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
    tied, shard = VARIANTS[request.param]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE, tie_word_embeddings=tied)).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    sharded = (path / "model.safetensors.index.json").is_file()
    assert sharded == (shard is not None)
    if sharded:  # the embedding and the head live in different shards from the layers
        files = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert len(files) > 2
    return model, path, tied


class Reads:
    """Every tensor name read through safetensors.safe_open, while active."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        real = safetensors.safe_open
        reads = self

        class Spy:
            def __init__(self, *args, **kwargs):
                self.f = real(*args, **kwargs)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                reads.names.append(name)
                return self.f.get_tensor(name)

        monkeypatch.setattr(safetensors, "safe_open", Spy)


def test_head_equals_the_full_models_and_nothing_else_is_read(saved, monkeypatch):
    model, path, tied = saved
    reads = Reads(monkeypatch)
    target = load_head_only_target(path, torch.float32, torch.device("cpu"))
    want = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    assert reads.names == want  # no decoder layer tensor was ever read
    assert torch.equal(target.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(target.lm_head.weight, model.lm_head.weight)
    assert (target.lm_head.weight is target.embed_tokens.weight) == tied
    V, H = SHAPE["vocab_size"], SHAPE["hidden_size"]
    params = list(target.parameters())
    assert sum(p.numel() for p in params) == V * H * (1 if tied else 2)  # no decoder layers held
    assert target.info["bytes"] == V * H * 4 * (1 if tied else 2) and target.info["tied"] == tied
    assert not any(p.requires_grad for p in params)
    ids = torch.tensor([3, 1, 4])
    torch.testing.assert_close(target.lm_head(target.embed_tokens(ids)), model.lm_head(model.model.embed_tokens(ids)))


def test_shapes_and_draft_spec_equal_the_full_adapters(saved):
    _, path, _ = saved
    full = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))
    head = load_head_only_target(path, torch.bfloat16, torch.device("cpu"))
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "rope_theta", "rms_eps", "default_mask_token_id"):
        assert getattr(head, key) == getattr(full, key), key
    assert head.lm_head.weight.dtype == head.embed_tokens.weight.dtype == torch.bfloat16
    cfg = load_config(None, ["model.target.kind=hf", f"model.target.path={path}", "model.draft.mask_token_id=5",
                                  "model.draft.target_layer_ids=[0,2]"])
    assert draft_spec(cfg, head) == draft_spec(cfg, full)


def test_load_hf_head_returns_modules_and_info(saved):
    _, path, tied = saved
    embed, lm_head, info = load_hf_head(path, torch.float16, "cpu")
    assert isinstance(embed, torch.nn.Embedding) and isinstance(lm_head, torch.nn.Linear)
    assert embed.weight.dtype == lm_head.weight.dtype == torch.float16
    assert info["tensors"] == ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    assert all(f.startswith(str(path)) for f in info["files"])


def test_missing_head_is_an_error_naming_the_file(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE)).save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["lm_head.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(KeyError, match=r"model\.safetensors\.index\.json: no tensor 'lm_head\.weight'"):
        load_hf_head(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_head(tmp_path, torch.float32, "cpu")


def test_config_facts_error_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="'hidden_size'"):
        head_mod.shape_facts({"num_attention_heads": 4, "vocab_size": 3}, "x/config.json")
