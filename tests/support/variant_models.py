"""Every registered drafter variant at the tests' tiny shape, for the variant contract tests
(unit/test_variant_contract.py, integration/test_variant_ranks.py, integration/test_variant_runs.py).

A variant added to `models.variants.VARIANTS` is picked up by all three; it only adds an entry here when
its defaults are too large for a test (a tiny spec's options) or its run needs keys of its own."""
from __future__ import annotations

import helpers
import torch

from dflash_dist.models.drafter import DFlashDrafter
from dflash_dist.models.variants import VARIANTS

NAMES = sorted(VARIANTS)

# The variant options (its `Model` fields) that shrink a variant's modules to the tiny spec (hidden 32, vocabulary 48).
TINY_OPTIONS = {"dflash2": dict(conv_group_size=8, selector_top_k=5, selector_rank=8),
                "dspark": dict(markov_rank=6, confidence_head_with_markov=True),
                "domino": dict(gru_hidden_dim=10, emb_dim=6)}

# The same as config keys, for runs and for the forecasts (which read a loaded config).
CONFIG_OPTIONS = {"dflash2": ["variant.selector_rank=16"],
                  "dspark": ["variant.markov_rank=8"],
                  "domino": ["variant.gru_hidden_dim=12", "variant.emb_dim=8"]}


def tiny_spec(name: str):
    return helpers.tiny_spec(variant=name, **TINY_OPTIONS.get(name, {}))


def feat_dim(spec) -> int:
    """A token's feature width as the target sends it: the captured layers', and the final hidden state
    when the variant asks for it (`Needs.final_hidden`)."""
    return (len(spec.target_layer_ids) + int(spec.family.needs.final_hidden)) * spec.hidden_size


def make_model(spec, seed: int = 0) -> DFlashDrafter:
    """The drafter with every parameter moved off its initial value: a head that starts at zero or at the
    identity (DSpark's W2, Domino's delta, DFlash 2's kernels) would hide its gradient paths."""
    torch.manual_seed(seed)
    model = DFlashDrafter(spec)
    model.attach_target_head(torch.nn.Embedding(spec.vocab_size, spec.hidden_size),
                             torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model
