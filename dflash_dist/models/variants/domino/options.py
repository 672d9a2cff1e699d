"""Domino's options: the config's `variant` section under model.draft.variant=domino (config keys
`variant.<name>`). `DominoModel` fixes the drafter (DraftSpec.options; exported in dflash_config as SGLang
reads them, `emb_dim` also at the top level); `DominoOptions` adds its loss schedule."""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import num


@dataclass(frozen=True)
class DominoModel:
    gru_hidden_dim: int = num(1024, ge=1)  # hidden size G of the GRU over the previous tokens
    emb_dim: int = num(256, ge=1)  # width E of the delta's Linear(H + G, E) -> SiLU -> Linear(E, V)


@dataclass(frozen=True)
class DominoOptions(DominoModel):
    # (1 - lambda) CE(final logits) + lambda CE(base logits), lambda falling linearly from 1 to 0 over this
    # share of the run's optimizer steps (loss.py; 1.0: the whole run).
    lambda_fraction: float = num(1.0, gt=0, le=1)


OLD_KEYS = {"model.draft.gru_hidden_dim": "gru_hidden_dim", "model.draft.domino_emb_dim": "emb_dim",
            "objective.domino_lambda_fraction": "lambda_fraction"}
