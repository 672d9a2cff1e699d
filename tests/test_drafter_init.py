"""A fresh drafter against a head tied to the embedding starts near a uniform guess (issue 27 item 8):
without the scaled final norm it scores its own input (the mask token) far above every other token."""
import math
from types import SimpleNamespace

import torch
from torch import nn

from dflash_dist.models.build import build_drafter
from dflash_dist.models.drafter import DraftSpec

V, H, B = 512, 64, 8
SPEC = DraftSpec(vocab_size=V, hidden_size=H, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                 head_dim=16, rope_theta=1e4, rms_eps=1e-6, block_size=B, mask_token_id=5,
                 target_layer_ids=(0, 1), num_target_layers=4)


def _target(tied: bool):
    g = torch.Generator().manual_seed(0)
    emb = nn.Embedding(V, H, _weight=torch.randn(V, H, generator=g) * 3 / math.sqrt(H))  # rows of norm ~3
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight if tied else nn.Parameter(torch.randn(V, H, generator=g) * 3 / math.sqrt(H))
    return SimpleNamespace(embed_tokens=emb, lm_head=head)


def _fresh_loss(tied: bool):
    model = build_drafter(SPEC, _target(tied), seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    N = 64
    ids = torch.randint(0, V, (N,), generator=g)
    feats = torch.randn(N, 2 * H, generator=g)
    anchors = torch.arange(8, N - B, 3)
    with torch.no_grad():
        logits = model(feats, ids, torch.tensor([0, N]), torch.arange(N), anchors, torch.tensor([0, len(anchors)]))
    labels = ids[anchors[:, None] + torch.arange(B)][:, 1:]
    ce = nn.functional.cross_entropy(logits[:, 1:].reshape(-1, V), labels.reshape(-1)).item()
    return model, ce, logits[:, 1:].softmax(-1)[..., SPEC.mask_token_id].mean().item()


def test_a_tied_head_starts_near_a_uniform_guess_not_at_its_mask_token():
    model, ce, p_mask = _fresh_loss(tied=True)
    assert ce < math.log(V) + 1.0, ce  # at most 1 nat above a uniform guess (norm weight 1: 26.6 nats)
    assert p_mask < 0.05, p_mask  # its own input, the mask token, is no near-certain guess (weight 1: 1.00)
    assert torch.allclose(model.norm.weight, torch.full((H,), H ** -0.5))


def test_an_untied_head_keeps_the_usual_final_norm():
    model, _, p_mask = _fresh_loss(tied=False)
    assert torch.equal(model.norm.weight, torch.ones(H))
    assert p_mask < 0.05, p_mask  # an untied head does not score the input embedding as its own token
