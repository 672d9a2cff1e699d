"""A fresh drafter starts from the usual initialisation, its final norm at 1, also against a head tied to
the embedding (SmolLM2). There the untrained drafter scores its own input, the mask token, far above every
other token (a first loss far above ln V); a final norm started at 1/sqrt(H) removed that, but held the
logits' scale down for about 0.3 / lr steps and slowed learning (docs/benchmarks.md, "A drafter's first
steps on a tied head"), so the spike is kept: it lasts a few steps."""
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


def _fresh(tied: bool):
    model = build_drafter(SPEC, _target(tied), seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    N = 64
    ids = torch.randint(0, V, (N,), generator=g)
    feats = torch.randn(N, 2 * H, generator=g)
    anchors = torch.arange(8, N - B, 3)
    with torch.no_grad():
        logits = model.block_logits(feats, ids, torch.tensor([0, N]), torch.arange(N), anchors,
                                    torch.tensor([0, len(anchors)]))
    return model, logits[:, 1:].softmax(-1)[..., SPEC.mask_token_id].mean().item()


def test_the_final_norm_starts_at_one_and_a_tied_head_first_scores_the_mask_token():
    tied, p_tied = _fresh(tied=True)
    untied, p_untied = _fresh(tied=False)
    assert torch.equal(tied.norm.weight, torch.ones(H)) and torch.equal(untied.norm.weight, torch.ones(H))
    assert p_tied > 0.9, p_tied  # the tied head scores the input embedding as its own token: the first steps' spike
    assert p_untied < 0.05, p_untied  # an untied head does not
