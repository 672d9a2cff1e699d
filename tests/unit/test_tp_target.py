"""Target replicas: a tensor-parallel split that would cut attention heads, or experts, is refused at
load (tests/integration/test_tp_target_ranks.py runs a two-rank replica)."""
from __future__ import annotations

import pytest
from transformers import Qwen3Config

SHAPE = dict(vocab_size=102, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             initializer_range=0.1)  # activations O(1), so atol=1e-5 is tight; an even vocabulary:
# transformers < 5.20 (which vLLM 0.32 pins) refuses an lm_head whose rows the replica cannot split evenly


def test_a_split_that_cuts_heads_is_refused():
    from dflash_dist.models.hf_target import _check_shardable
    with pytest.raises(ValueError, match="model.target.tensor_parallel"):
        _check_shardable(Qwen3Config(**{**SHAPE, "num_key_value_heads": 1}), 2, False)
    with pytest.raises(ValueError, match="expert"):
        _check_shardable(Qwen3Config(**SHAPE), 2, True)
