"""DSpark's options: the config's `variant` section under model.draft.variant=dspark (config keys
`variant.<name>`). `DSparkModel` fixes the drafter (DraftSpec.options; exported at config.json's top level
and in dflash_config, where vLLM's Qwen3DSparkModel reads them); `DSparkOptions` adds its loss terms'
weights (loss.py: the DSpark paper's 0.1 / 0.9 / 1)."""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import num, one_of


@dataclass(frozen=True)
class DSparkModel:
    markov_rank: int = num(256, ge=1)  # rank r of the Markov bias W2 . W1[prev] (V x r each)
    markov_head_type: str = one_of("vanilla", "vanilla")  # the bias as vLLM 0.32's Qwen3 DSpark serves it
    enable_confidence_head: bool = True  # sigmoid(w . [h; W1[prev]] + b), an acceptance estimate per slot
    confidence_head_with_markov: bool = False  # the confidence head also reads W1[prev]


@dataclass(frozen=True)
class DSparkOptions(DSparkModel):
    ce_weight: float = num(0.1, ge=0)  # cross-entropy on the data token
    l1_weight: float = num(0.9, ge=0)  # L1 distance to the target's distribution
    confidence_weight: float = num(1.0, ge=0)  # the confidence head's BCE


OLD_KEYS = {**{f"model.draft.{k}": k for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                                 "confidence_head_with_markov")},
            "objective.dspark_ce_weight": "ce_weight", "objective.dspark_l1_weight": "l1_weight",
            "objective.dspark_confidence_weight": "confidence_weight"}
