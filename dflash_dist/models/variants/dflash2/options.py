"""DFlash 2's options: the config's `variant` section under model.draft.variant=dflash2 (config keys
`variant.<name>`). `DFlash2Model` fixes the drafter (DraftSpec.options; exported in dflash_config under
the same names, z-lab's `dflash2-config.json`'s); `DFlash2Options` adds the selector term's knobs."""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import num


@dataclass(frozen=True)
class DFlash2Model:
    conv_kernel_size: int = num(2, ge=1)  # taps of the grouped convolution (in-block rows it reads)
    conv_group_size: int = num(16, ge=1)  # channels per delta group (must divide the hidden size)
    selector_top_k: int = num(16, ge=1)  # candidates per drafted position
    selector_rank: int = num(256, ge=1)  # rank R of the codebooks (vocab x R each)
    output_multiplier: float = num(1.0, gt=0)  # the selector's unary logits x this, then soft-capped
    final_logit_softcapping: float = num(0.0, ge=0)  # cap * tanh(z / cap); 0 = none


@dataclass(frozen=True)
class DFlash2Options(DFlash2Model):
    # Weight alpha of the selector's K-way cross-entropy (loss.py) beside the unary loss (1.0: speculators'
    # and SpecForge's default); selector_detach: none of its gradient into the backbone.
    selector_weight: float = num(1.0, ge=0)
    selector_detach: bool = False


# The keys these options had before the `variant` section (still taken, with a WARNING).
OLD_KEYS = {**{f"model.draft.{k}": k for k in ("conv_kernel_size", "conv_group_size", "selector_top_k",
                                                 "selector_rank", "output_multiplier", "final_logit_softcapping")},
            "objective.selector_weight": "selector_weight", "objective.selector_detach": "selector_detach"}
