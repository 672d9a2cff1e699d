"""A transformers mixture-of-experts LM (tiny Qwen3-MoE) as the target: packed capture equals each
sequence run alone through transformers, and the load-time self-check accepts it."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_capture_matches_alone
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from dflash_dist.models.hf_target import check_packed_capture, load_hf_target

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
LENGTHS = (13, 5, 21)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE)).eval()
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return model, path


def test_moe_packed_capture_matches_each_sequence_alone(saved):
    ref, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))  # runs the self-check
    assert target.num_experts == 8
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen) for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    ids, H, layer_ids = torch.cat(seqs), SHAPE["hidden_size"], [2, 0]
    feats, _ = assert_capture_matches_alone(target, ref, seqs, cu, pos, layer_ids, H)
    with torch.no_grad():
        # The experts are really used: tokens of one layer go to several different experts.
        routed = ref.model.layers[0].mlp.gate(ref.model.embed_tokens(ids))[2]
        assert routed.unique().numel() > SHAPE["num_experts_per_tok"]
        # The test has teeth: one causal run over the whole stream (no boundaries) differs.
        joined = ref(input_ids=ids[None], output_hidden_states=True).hidden_states[1][0]
        assert not torch.allclose(joined[cu[1]:], feats[cu[1]:, H:], atol=1e-3)


def test_self_check_refuses_a_capture_that_crosses_sequences(saved, monkeypatch):
    _, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"), verify=False)
    import dflash_dist.models.hf_target as hft
    whole = hft.packed_causal_attention
    # One causal run over the packed stream: attention leaks across the boundary.
    monkeypatch.setattr(hft, "packed_causal_attention", lambda q, k, v, cu, **kw: whole(q, k, v, cu[[0, -1]]))
    with pytest.raises(ValueError, match="does not reproduce"):
        check_packed_capture(target)
