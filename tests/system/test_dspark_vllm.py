"""DSpark against its serving contract: vLLM 0.32's own `Qwen3DSparkForCausalLM` built on CPU from an
export (float32), its `load_weights` taking every exported tensor into the parameter it names, and its
slot logits (`compute_draft_logits` + `markov_bias(markov_embed(prev))`), confidence
(`compute_confidence`) and `DSparkSpeculator._sample_sequential`'s greedy walk equal to the project's on
the same final states and previous tokens.

vLLM's CPU build refuses to start a DSpark engine (Model Runner V1 has no DSpark speculator, V2 needs
Triton), so the model class is built directly under the engine's own config, with the V1 runner's
refusal switched off for that config only: what is tested is the model and its loader, not a runner."""
from __future__ import annotations

import socket

import pytest
import torch
from evaluate_fixtures import save_target, target_overrides
from safetensors.torch import load_file

from dflash_dist.config import load_config
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.export import export_drafter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RANK = 8


@pytest.fixture(scope="module", params=[True, False], ids=["conf-with-markov", "conf-on-hidden"])
def served(request, tmp_path_factory):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    root = tmp_path_factory.mktemp("dspark_vllm")
    model_dir = save_target(root / "target")
    cfg = load_config(overrides=target_overrides(model_dir) + [
        "model.draft.variant=dspark", f"variant.markov_rank={RANK}",
        f"variant.confidence_head_with_markov={str(request.param).lower()}"])
    target = build_target(cfg, torch.device("cpu"))
    spec = draft_spec(cfg, target)
    drafter = build_drafter(spec, target, seed=0, device=torch.device("cpu"))
    with torch.no_grad():  # every tensor moved off its init (W2 starts at zero, norms at one), so that
        for name, p in drafter.named_parameters():  # equal values prove a load, not a shared init
            p.add_(torch.randn_like(p) * (0.5 if "_head" in name else 0.1))
    out = export_drafter(spec, drafter.state_dict(), root / "draft", dtype=torch.float32)
    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=256,
                      speculative_config={"method": "dspark", "model": str(out),
                                          "num_speculative_tokens": spec.block_size})
    mp = pytest.MonkeyPatch()
    mp.setattr(VllmConfig, "_validate_v1_model_runner", lambda self: None)
    try:
        vc = args.create_engine_config()
    finally:
        mp.undo()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)
        try:
            model = Qwen3DSparkForCausalLM(vllm_config=vc)
            tensors = load_file(str(out / "model.safetensors"))
            model.load_weights(tensors.items())  # returns nothing: the parameters are compared instead
            loaded = {n: p.detach().clone() for n, p in model.named_parameters()}  # before any CPU repacking
            with torch.no_grad():  # load_dspark_model shares the target's head; the export has none
                model.lm_head.weight.copy_(target.lm_head.weight)
            # What vLLM's loader runs after load_weights (the CPU linear kernels are chosen there).
            process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
            yield vc, model, drafter, tensors, loaded
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def test_load_weights_takes_every_exported_tensor(served):
    _, _, drafter, tensors, params = served
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    taken = set()
    for name, p in params.items():
        if not name.startswith("model.") or name in ("model.mask_embedding", "model.embed_tokens.weight"):
            continue  # the shared embedding and the head are the target's, the mask embedding unused
        ours = name.removeprefix("model.")
        parts = next(([ours.replace(f, x) for x in xs] for f, xs in fused.items() if f in ours), [ours])
        assert all(k in tensors for k in parts), name
        torch.testing.assert_close(p, torch.cat([tensors[k] for k in parts]), rtol=0, atol=0, msg=name)
        taken |= set(parts)
    assert taken == set(tensors), set(tensors) - taken
    assert tensors.keys() == drafter.state_dict().keys()


def test_slot_logits_confidence_and_the_walk_equal_vllms(served):
    from vllm.config import set_current_vllm_config
    vc, model, drafter, _, _ = served
    s = drafter.spec
    gen = torch.Generator().manual_seed(0)
    N, B, H = 5, s.block_size, s.hidden_size
    hidden = torch.randn(N * B, H, generator=gen)
    prev = torch.randint(0, s.vocab_size, (N * B,), generator=gen)
    with set_current_vllm_config(vc), torch.no_grad():
        e = model.markov_embed(prev)
        want_logits = model.compute_draft_logits(hidden) + model.markov_bias(e)
        want_conf = model.compute_confidence(hidden, e)
        # DSparkSpeculator._sample_sequential at temperature 0 (its argmax path).
        h = hidden.view(N, B, H)
        base = model.compute_draft_logits(hidden).view(N, B, -1)
        tok, walk = prev[:N], []
        for i in range(B):
            tok = (base[:, i] + model.markov_bias(model.markov_embed(tok))).argmax(-1)
            walk.append(tok)
    markov, conf = drafter.markov_head, drafter.confidence_head
    with torch.no_grad():
        ours = drafter.lm_head(hidden) + markov.bias(markov.embed(prev))
        torch.testing.assert_close(ours, want_logits, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(torch.sigmoid(conf.logit(hidden, markov.embed(prev))), want_conf,
                                   rtol=1e-6, atol=1e-6)
    assert torch.equal(drafter.block_tokens(h, prev[:N]), torch.stack(walk, 1))
