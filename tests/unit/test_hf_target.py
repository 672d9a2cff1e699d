"""The transformers adapter: packed capture equals each sequence run alone through transformers."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_capture_matches_alone  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

from dflash_dist.config import load_config  # noqa: E402
from dflash_dist.models.build import draft_spec  # noqa: E402
from dflash_dist.models.hf_target import load_hf_target  # noqa: E402

SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             initializer_range=0.1)  # activations O(1) (not 0.02's O(0.1)), so atol=1e-5 is tight
LENGTHS = (13, 5, 21)



@pytest.fixture(scope="module", params=["qwen3", "llama"])
def saved(request, tmp_path_factory):
    """(reference transformers model, its saved local directory)."""
    theta = {"qwen3": 1e6, "llama": 5e4}[request.param]
    cfg = (Qwen3Config if request.param == "qwen3" else LlamaConfig)(**SHAPE, rope_theta=theta)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def packed_batch():
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen) for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    return seqs, torch.cat(seqs), cu, pos


def test_packed_capture_matches_each_sequence_alone(saved):
    ref_model, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))
    seqs, ids, cu, pos = packed_batch()
    layer_ids = [2, 0]  # any order: features follow layer_ids
    H = SHAPE["hidden_size"]
    feats, logits = assert_capture_matches_alone(target, ref_model, seqs, cu, pos, layer_ids, H)
    assert logits.shape == (ids.numel(), SHAPE["vocab_size"])
    with torch.no_grad():
        # What the target role sends for distillation comes from the final hidden state, not from logits.
        _, final = target.capture(ids, cu, pos, layer_ids, final_hidden=True)
        torch.testing.assert_close(target.lm_head(final), logits, atol=1e-5, rtol=1e-5)
        # The test has teeth: one causal run over the whole stream (no boundaries) differs.
        joined = ref_model(input_ids=ids[None], output_hidden_states=True).hidden_states[1][0]
        assert not torch.allclose(joined[cu[1]:], feats[cu[1]:, H:], atol=1e-3)


def test_capture_stops_after_last_captured_layer(saved):
    _, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))
    calls: list[int] = []
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: calls.append(k))
             for k, layer in enumerate(target.base.layers)]
    norm_calls: list[int] = []
    hooks.append(target.base.norm.register_forward_hook(lambda *a: norm_calls.append(1)))
    _, ids, cu, pos = packed_batch()
    feats, logits = target.capture(ids, cu, pos, [0, 1])
    assert calls == [0, 1] and logits is None and not norm_calls
    calls.clear()
    target.capture(ids, cu, pos, [1], need_logits=True)
    assert calls == [0, 1, 2, 3] and norm_calls == [1]
    for h in hooks:
        h.remove()


def test_interface_frozen_and_config_attributes(saved):
    ref_model, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (101, 64, 4)
    assert (target.num_heads, target.num_kv_heads, target.head_dim, target.intermediate_size) == (4, 2, 16, 128)
    expected_theta = 50000.0 if ref_model.config.model_type == "llama" else 1000000.0
    assert target.rope_theta == expected_theta and target.rms_eps == ref_model.config.rms_norm_eps
    assert isinstance(target.embed_tokens, torch.nn.Embedding) and isinstance(target.lm_head, torch.nn.Linear)
    # Outside capture the wrapped model keeps its own attention implementation.
    assert target.hf.config._attn_implementation == ref_model.config._attn_implementation
    cfg = load_config(overrides=["model.target.kind=hf", f"model.target.path={path}",
                                 "model.draft.target_layer_ids=[0,2]"])
    spec = draft_spec(cfg, target)
    assert (spec.num_target_layers, spec.target_layer_ids, spec.hidden_size) == (4, (0, 2), 64)
    assert (spec.vocab_size, spec.mask_token_id, spec.rope_theta) == (101, 100, target.rope_theta)


def test_bf16_keeps_rope_frequencies_in_float32(saved):
    _, path = saved
    target = load_hf_target(path, dtype=torch.bfloat16, device=torch.device("cpu"))
    target = target.to(dtype=torch.bfloat16)  # what build_target does
    assert target.embed_tokens.weight.dtype == torch.bfloat16
    assert target.base.rotary_emb.inv_freq.dtype == torch.float32
    _, ids, cu, pos = packed_batch()
    feats, _ = target.capture(ids, cu, pos, [1])
    assert feats.dtype == torch.bfloat16 and torch.isfinite(feats).all()


def test_kv_cached_greedy_matches_recompute(saved):
    ref_model, path = saved
    target = load_hf_target(path, dtype=torch.float32, device=torch.device("cpu"))
    seq = torch.randint(0, SHAPE["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(2))
    got = target.greedy(seq, 8)
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, ref_model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq[:, 6:])


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_target(tmp_path / "nope", dtype=torch.float32, device=torch.device("cpu"))


def test_default_mask_token_is_the_tokenizers_or_the_first_unused_row(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from dflash_dist.models.head import default_mask_token_id
    vocab = {f"w{i}": i for i in range(40)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))
    fast.save_pretrained(tmp_path / "plain")
    assert default_mask_token_id(tmp_path / "plain", vocab_size=64) == 40  # rows 40..63 are unused
    assert default_mask_token_id(tmp_path / "plain", vocab_size=40) is None  # every row is a token
    fast.add_special_tokens({"mask_token": "<mask>"})
    fast.save_pretrained(tmp_path / "masked")
    assert default_mask_token_id(tmp_path / "masked", vocab_size=64) == 40  # the added <mask> token
    assert default_mask_token_id(tmp_path / "none", vocab_size=64) is None
