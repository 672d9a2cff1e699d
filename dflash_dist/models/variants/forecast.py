"""What a drafter variant adds to the forecasts: the interface its `Variant.forecast` answers.

The memory model (`forecast/memory.py`) and the cost model (`forecast/cost.py`) count the DFlash drafter's
tensors and work; a variant's own modules (its heads, convolutions, loss) add parameters, saved bytes and
work that only it has. Every variant's object answers the same five questions, so the two models ask them
(`forecast.variants.forecast_of`) without knowing which variant runs:

  params           parameters beyond the DFlash drafter's (exact: tested against the built module)
  layer_row_bytes  bytes each draft layer saves per block row beyond a DFlash layer's
  chunk_bytes      bytes one anchor chunk keeps for backward beyond the plain head's, and the transients
                   that replace the plain loss chunk (its row chunk) or come after it (a walk)
  cost_terms       work beyond the DFlash drafter's, as named `Term`s
  distill_passes   how many full-vocabulary distillation passes a batch makes under objective.labels=target_full

`VariantForecast` answers them for the plain DFlash drafter (nothing beyond what the models count) and is
`base.Variant.forecast`'s default; a variant with modules of its own subclasses it in its folder
(`<name>/forecast.py`, beside the modules it counts) and declares it as its `forecast`.

The questions take the forecasts' own types (`forecast.shapes.ModelShapes`, `forecast.job.Precision`),
which models/ may not import (tests/unit/test_layout.py): the annotations name them by their dotted path
and nothing resolves them. `Term` and `ChunkBytes`, the values the answers are made of, live here, a layer
below the models that add them up.
"""
from __future__ import annotations

from dataclasses import dataclass

import dflash_dist  # the root of the annotations' dotted names (the package itself: no module of forecast/)
from dflash_dist.config import Config


@dataclass(frozen=True)
class Term:
    """An amount of one kind of work (`forecast.work.KINDS`): the cost model's unit, which
    `forecast.work.Device` turns into seconds."""
    kind: str
    amount: float  # FLOPs (compute kinds) or bytes
    useful: float | None = None  # of the FLOPs, those the model needs (None: all; a recompute: 0)


@dataclass(frozen=True)
class ChunkBytes:
    """One anchor chunk's bytes beyond the plain DFlash head's."""
    saved: int = 0  # kept for backward until the chunk's backward (the loss's input gradients, a walk's rows)
    loss: int = 0  # one row chunk of the variant's loss, in place of the plain head's (0: the plain head's)
    after: int = 0  # a transient after the loss's row chunks are freed (DFlash 2's greedy walk)


class VariantForecast:
    """The plain DFlash drafter: the models count it all, so each answer is nothing beyond. Every `cfg` is a
    validated config: its `variant` section is the variant's typed options (`config.load_config`, or
    `models.variants.with_variant` where a benchmark switches the variant)."""

    def params(self, s: "dflash_dist.forecast.shapes.ModelShapes", cfg: Config) -> int:
        """Trainable parameters of the variant's own modules (the drafter's count is
        `ModelShapes.draft_params` plus this)."""
        return 0

    def layer_row_bytes(self, s: "dflash_dist.forecast.shapes.ModelShapes",
                        p: "dflash_dist.forecast.job.Precision", cfg: Config) -> int:
        """Bytes one draft layer keeps for backward per block row beyond a DFlash layer's."""
        return 0

    def chunk_bytes(self, s: "dflash_dist.forecast.shapes.ModelShapes", p: "dflash_dist.forecast.job.Precision",
                    cfg: Config, rows: int, block_rows: int, anchors: int) -> ChunkBytes:
        """`rows`: the loss's row chunk (objective.loss_rows, at most the chunk's); `block_rows`: the
        chunk's anchors x block_size; `anchors`: the chunk's anchors."""
        return ChunkBytes()

    def cost_terms(self, s: "dflash_dist.forecast.shapes.ModelShapes", cfg: Config, c: int, block_rows: int,
                   rows: float, anchors: int) -> dict[str, Term]:
        """`c`: bytes of the compute dtype; `rows`: block rows with a label (expected). The terms join the
        cost model's own in one dict (`forecast.cost`), so each name starts with the variant's."""
        return {}

    def distill_passes(self, cfg: Config) -> float:
        """Full-vocabulary distillation passes a batch makes under objective.labels=target_full (one: the
        plain head's)."""
        return 1.0
