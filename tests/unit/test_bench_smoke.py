"""Each in-process benchmark runs at tiny sizes, prints its table and writes JSON; gpu_check without CUDA
and its FLOP count."""
import json

import pytest
import torch

from dflash_dist.bench import attention as bench_attention
from dflash_dist.bench import dflash2_step, gpu_check, variant_step


def test_dflash2_step_bench_tiny(tmp_path, capsys):
    out = tmp_path / "dflash2_step.json"
    dflash2_step.main(["--seqs", "2", "--prompt", "8", "--reply", "24", "--num-anchors", "4", "--vocab", "512",
                       "--hidden", "64", "--reps", "1", "--warmup", "0", "--json", str(out)])
    assert "| dflash2 |" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["shape"]["anchors"] == 8 and set(res["step_s"]) == {"dflash", "dflash2"}
    assert res["ratio"] == res["step_s"]["dflash2"] / res["step_s"]["dflash"] and len(res["dflash2_parts_s"]) == 4


def test_variant_step_bench_tiny(tmp_path, capsys):
    """Every family variant's step beside DFlash's on one batch (the final-state block where one reads it)."""
    out = tmp_path / "variant_step.json"
    variant_step.main(["--seqs", "2", "--prompt", "8", "--reply", "24", "--num-anchors", "4", "--vocab", "512",
                       "--hidden", "576", "--reps", "1", "--warmup", "0", "--json", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["anchors"] == 8 and list(res["seconds"]) == ["dflash", "dflash2", "dspark", "domino", "dflash+full"]
    for name, s in res["seconds"].items():
        assert s > 0 and res["ratio"][name] == s / res["seconds"]["dflash"] and f"| {name} |" in text


def test_attention_bench_tiny(tmp_path, capsys):
    out = tmp_path / "attention.json"
    rows = bench_attention.main(["--preset", "tiny", "--impls", "ref", "padded", "--reps", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "ms/call" in text and "padded" in text
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    by = {(r["op"], r["mode"], r["impl"]): r for r in rows}
    assert set(by) == {(op, mode, impl) for op, mode in [("target causal", "fwd"), ("drafter block", "fwd"),
                                                        ("drafter block", "fwd+bwd")] for impl in ("ref", "padded")}
    for r in rows:
        assert r["max_abs_diff_vs_ref"] < 1e-5  # padded computes the same attention, on padded tensors
        assert r["computed_tokens"] >= r["real_tokens"]
    padded, packed = by[("target causal", "fwd", "padded")], by[("target causal", "fwd", "ref")]
    assert padded["computed_tokens"] > packed["computed_tokens"] == packed["real_tokens"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_without_cuda_says_so(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_check_flop_count():
    """Qwen3-8B: ~0.19 G weights per layer, so 2 FLOPs per weight per token dominates at short lengths."""
    from dflash_dist.forecast.cost import target_forward_flops  # the count the GPU check's MFU uses
    from dflash_dist.forecast.shapes import model_shapes
    shapes = model_shapes(gpu_check.reference_config(dry=False))
    per_layer_weights = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 12288
    assert per_layer_weights == 192_937_984
    assert sum(target_forward_flops(shapes, [1], 1)) == 2 * per_layer_weights + 4 * 32 * 128
    assert sum(target_forward_flops(shapes, [3, 2], 36)) == 36 * (2 * per_layer_weights * 5 + 4 * 32 * 128 * (6 + 3))
