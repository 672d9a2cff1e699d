"""Target replicas of two ranks: the sharded target captures what the whole target does.

One spawn of 3 gloo processes serves every case: rank 0 stands for a drafter (it only joins the world's
group creation and the final barrier, so a load that needed it would hang and fail the test), ranks 1
and 2 are the replica. Each case loads a tiny target saved to disk, sharded over the replica (the
load-time self-check runs sharded too), captures a packed batch, and reports what it computed.
"""
from __future__ import annotations

import pytest
import torch
from helpers import spawn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from dflash_dist.models.hf_target import load_hf_target

SHAPE = dict(vocab_size=102, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             initializer_range=0.1)  # activations O(1), so atol=1e-5 is tight; an even vocabulary:
# transformers < 5.20 (which vLLM 0.32 pins) refuses an lm_head whose rows the replica cannot split evenly
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
LENGTHS = (13, 5, 21)
LAYERS = [2, 0]
# case -> (model, engine, expert_parallel)
CASES = {"dense": ("qwen3", "auto", False), "dense_torch": ("qwen3", "torch", False),
         "moe": ("qwen3_moe", "auto", False), "moe_ep": ("qwen3_moe", "auto", True)}


def save_tiny(kind: str, path) -> None:
    cfg = Qwen3MoeConfig(**SHAPE, **MOE) if kind == "qwen3_moe" else Qwen3Config(**SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def packed_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (sum(LENGTHS),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids, cu, pos


def local_shape(p) -> tuple:
    return tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)


def replica_worker(rank, q, root):
    import torch.distributed as dist
    group = dist.new_group([1, 2])  # every rank creates every group, as dist.py does
    try:
        out = replica_cases(root, group) if rank else {}
        dist.barrier()  # rank 0 stays until the replica is done
    except Exception:  # report it, so the test fails with the cause rather than an exit code
        import traceback
        q.put((rank, {"error": traceback.format_exc()}))
        raise
    q.put((rank, out))


def replica_cases(root, group) -> dict:
    import dflash_dist.models.hf_target as hft
    heads: list = []  # (query heads, key/value heads) that reach the packed attention
    inner = hft.packed_causal_attention

    def recording(q, k, v, cu, **kw):
        heads.append((q.shape[1], k.shape[1]))
        return inner(q, k, v, cu, **kw)
    hft.packed_causal_attention = recording
    ids, cu, pos = packed_batch()
    out = {}
    for case, (kind, engine, ep) in CASES.items():
        target = load_hf_target(root / kind, torch.float32, torch.device("cpu"), tp_group=group,
                                expert_parallel=ep, engine=engine)
        heads.clear()
        feats, logits = target.capture(ids, cu, pos, LAYERS, need_logits=True)
        _, final = target.capture(ids, cu, pos, LAYERS, final_hidden=True)
        layer = target.base.layers[0]
        mlp = layer.mlp.experts.gate_up_proj if kind == "qwen3_moe" else layer.mlp.gate_proj.weight
        # numpy: tensors on a queue live in shared memory that dies with this process.
        out[case] = dict(feats=feats.numpy(), logits=logits.numpy(), final=final.numpy(), heads=sorted(set(heads)),
                         q_proj=local_shape(layer.self_attn.q_proj.weight), mlp=local_shape(mlp),
                         tensor_parallel=target.tensor_parallel)
    return out


@pytest.fixture(scope="module")
def replica_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_targets")
    for kind in ("qwen3", "qwen3_moe"):
        save_tiny(kind, root / kind)
    results = dict(spawn(3, replica_worker, root, timeout_s=45))
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        pytest.fail("a replica rank failed:\n" + errors[0])
    return root, results[1], results[2]


@pytest.mark.slow  # 3 processes loading transformers models
@pytest.mark.parametrize("case", list(CASES))
def test_two_rank_replica_captures_the_unsharded_features(replica_results, case):
    root, r1, r2 = replica_results
    kind, _, ep = CASES[case]
    whole = load_hf_target(root / kind, torch.float32, torch.device("cpu"))
    ids, cu, pos = packed_batch()
    feats, logits = whole.capture(ids, cu, pos, LAYERS, need_logits=True)
    _, final = whole.capture(ids, cu, pos, LAYERS, final_hidden=True)
    for got in (r1[case], r2[case]):
        assert got["tensor_parallel"] == 2
        for name, want in (("feats", feats), ("logits", logits), ("final", final)):
            torch.testing.assert_close(torch.from_numpy(got[name]), want, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")
    # Both ranks of the replica hold the same full features (either could send them).
    assert (r1[case]["feats"] == r2[case]["feats"]).all()
    # The weights really are split: half the query heads per rank, and the attention ran on the local
    # heads only (2 of 4 query heads, 1 of 2 key/value heads).
    assert r1[case]["q_proj"] == (SHAPE["num_attention_heads"] * SHAPE["head_dim"] // 2, SHAPE["hidden_size"])
    assert r1[case]["heads"] == [(SHAPE["num_attention_heads"] // 2, SHAPE["num_key_value_heads"] // 2)]
    if kind == "qwen3":
        assert r1[case]["mlp"] == (SHAPE["intermediate_size"] // 2, SHAPE["hidden_size"])
    elif ep:  # whole experts, half of them per rank
        assert r1[case]["mlp"] == (MOE["num_experts"] // 2, 2 * MOE["moe_intermediate_size"], SHAPE["hidden_size"])
    else:  # every expert, half of its channels per rank
        assert r1[case]["mlp"] == (MOE["num_experts"], MOE["moe_intermediate_size"], SHAPE["hidden_size"])
