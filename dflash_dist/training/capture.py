"""What a target computes for a drafter from one packed batch: the features, and for distillation labels
the target's own predictions. Used by target ranks and by colocated ranks alike; what travels, and how,
is parallel/transport.py's."""
from __future__ import annotations

import torch

from dflash_dist.parallel.transport import TargetLabels
from dflash_dist.training.objective import predictions_from_hidden


@torch.no_grad()
def capture_for_drafter(target, batch, layer_ids, objective, dtype: torch.dtype,
                        final_features: bool = False) -> tuple[torch.Tensor, TargetLabels | None]:
    """The features of `layer_ids` in the transfer dtype and, for distillation labels, the target's
    predictions (which need the whole forward; data labels stop after the last captured layer). With
    `final_features` (`Variant.final_hidden_features`) the final-normed last hidden state follows the
    layers' columns (the whole forward too)."""
    distill = objective.labels != "data"
    feats, final = target.capture(batch.input_ids, batch.cu_seqlens, batch.position_ids, layer_ids,
                                  final_hidden=distill or final_features)
    if final_features:
        feats = torch.cat([feats, final], dim=-1)
    if not distill:
        return feats.to(dtype), None
    ids, values = predictions_from_hidden(final, target.lm_head, objective.labels, objective.soft_top_k)
    return feats.to(dtype), TargetLabels(ids, values)
