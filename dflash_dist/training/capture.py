"""What a target computes for a drafter from one packed batch: the features, and for distillation labels
the target's own predictions. Used by target ranks and by colocated ranks alike."""
from __future__ import annotations

import torch

from dflash_dist.config import Config
from dflash_dist.models.build import compute_dtype
from dflash_dist.models.drafter import DraftSpec
from dflash_dist.training.objective import predictions_from_hidden, target_label_width
from dflash_dist.parallel.transport import PacketSpec, TargetLabels


def packet_spec(cfg: Config, spec: DraftSpec, device: torch.device) -> PacketSpec:
    """The one packet specification of a run (sender and receiver both build it from the config)."""
    t = cfg.transport.dtype
    dtype = compute_dtype(cfg.model.target.dtype if t == "auto" else t, device)
    return PacketSpec(feat_dim=len(spec.target_layer_ids) * spec.hidden_size, dtype=dtype,
                      label_width=target_label_width(cfg.objective.labels, cfg.objective.soft_top_k),
                      soft=cfg.objective.labels == "target_soft")


@torch.no_grad()
def capture_for_drafter(target, batch, layer_ids, objective, dtype: torch.dtype) -> tuple[torch.Tensor, TargetLabels | None]:
    """The features of `layer_ids` in the transfer dtype and, for distillation labels, the target's
    predictions (which need the whole forward; data labels stop after the last captured layer)."""
    distill = objective.labels != "data"
    feats, final = target.capture(batch.input_ids, batch.cu_seqlens, batch.position_ids, layer_ids,
                                  final_hidden=distill)
    if not distill:
        return feats.to(dtype), None
    ids, values = predictions_from_hidden(final, target.lm_head, objective.labels, objective.soft_top_k)
    return feats.to(dtype), TargetLabels(ids, values)
