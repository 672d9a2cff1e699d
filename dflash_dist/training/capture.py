"""What a target computes for a drafter from one packed batch: the features (with the target's final
state where `sends_final_hidden` says so), and for target_argmax / target_soft labels the target's own
predictions. Used by target ranks and by colocated ranks alike; what travels, and how,
is parallel/transport.py's."""
from __future__ import annotations

import torch

from dflash_dist.parallel.transport import TargetLabels, sends_final_hidden, target_label_width
from dflash_dist.training.objective import predictions_from_hidden


@torch.no_grad()
def capture_for_drafter(target, batch, layer_ids, objective, dtype: torch.dtype,
                        final_features: bool = False) -> tuple[torch.Tensor, TargetLabels | None]:
    """The features of `layer_ids` in the transfer dtype and, for target_argmax / target_soft labels, the
    target's predictions (which need the whole forward; data labels stop after the last captured layer).
    `final_features`: whether the variant asks for the final state (`Variant.needs.final_hidden`);
    where `sends_final_hidden` says so (it asks, or the labels are target_full) the final-normed last
    hidden state follows the layers' columns (the whole forward too). target_full sends no predictions:
    the drafter computes the distribution from that state in its loss's row chunks."""
    predicts = target_label_width(objective.labels, objective.soft_top_k) > 0
    final_block = sends_final_hidden(objective.labels, final_features)
    feats, final = target.capture(batch.input_ids, batch.cu_seqlens, batch.position_ids, layer_ids,
                                  final_hidden=predicts or final_block)
    if final_block:
        feats = torch.cat([feats, final], dim=-1)
    if not predicts:
        return feats.to(dtype), None
    ids, values = predictions_from_hidden(final, target.lm_head, objective.labels, objective.soft_top_k)
    return feats.to(dtype), TargetLabels(ids, values)
