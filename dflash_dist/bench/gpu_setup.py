"""Set-up shared by gpu_check's sections and gpu_grads: the device, the reference drafter at the
config's target shape, and random packed batches (a module of its own so neither imports the other)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dflash_dist.config import Config, default_target_layer_ids

if TYPE_CHECKING:
    import torch


def device(dry: bool) -> torch.device:
    import torch

    return torch.device("cpu") if dry else torch.device("cuda", 0)


def feature_layers(cfg: Config) -> list[int]:
    d, t = cfg.model.draft, cfg.model.target
    return list(d.target_layer_ids) or default_target_layer_ids(t.num_layers, d.num_feature_layers)


def packed_batch(lengths, supervised, vocab: int, dev: torch.device, seed: int = 0):
    """A PackedBatch of random tokens (never the last id, the drafter's mask token) whose last
    `supervised` tokens of every sequence carry the loss, as a chat sample's reply would."""
    import torch

    from dflash_dist.data.collate import PackedBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.long)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    ids = torch.randint(0, vocab - 1, (int(cu[-1]),), generator=g)
    pos = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lengths)
    first_sup = torch.repeat_interleave(lengths - torch.as_tensor(np.asarray(supervised), dtype=torch.long), lengths)
    return PackedBatch(ids, pos >= first_sup, cu).to(dev)


def reference_drafter(cfg, dev, compute):
    """(spec, DFlashDrafter) at the config's target shape, made on `dev`, with a random frozen head. The
    spec is the run's (`models.build.draft_spec`, the variant's fields included) from the shape alone."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from dflash_dist.models.build import draft_spec
    from dflash_dist.models.drafter import DFlashDrafter
    t = cfg.model.target
    shape = SimpleNamespace(**{k: getattr(t, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                                                           "num_kv_heads", "head_dim", "rope_theta", "rms_eps")},
                            num_layers=t.num_layers, max_position_embeddings=40960)
    spec = draft_spec(cfg, shape)
    with torch.device(dev):  # parameters made where they live: no host copy of a 4 GB model
        model = DFlashDrafter(spec, checkpoint_layers=cfg.model.draft.checkpoint_layers)
        embed = nn.Embedding(t.vocab_size, t.hidden_size, dtype=compute)
        head = nn.Linear(t.hidden_size, t.vocab_size, bias=False, dtype=compute)
    model.attach_target_head(embed, head)
    return spec, model
