"""The registry of DFlash-family drafter variants (`model.draft.variant`); the interface is `base.Variant`."""
from __future__ import annotations

from dflash_dist.config import ConfigError
from dflash_dist.models.variants.base import (LossChunk, LossWeights, RunProgress, Variant, accepted_lengths,
                                              check_trains)
from dflash_dist.models.variants.dflash import DFlash
from dflash_dist.models.variants.dflash2 import DFlash2
from dflash_dist.models.variants.domino import Domino
from dflash_dist.models.variants.dspark import DSpark

VARIANTS: dict[str, Variant] = {v.name: v for v in (DFlash(), DFlash2(), DSpark(), Domino())}


def variant_of(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(f"config key 'model.draft.variant': {name!r} is not one of "
                          f"{', '.join(VARIANTS)}") from None


def check_objective(cfg) -> None:
    """The variant's rules on a loaded config that need no target (config.py names no variant, so they
    run here: `train.main` right after loading, before any group forms, and `models.build.draft_spec`
    for every tool that builds a drafter): its loss weights train something (`base.check_trains`)."""
    check_trains(variant_of(cfg.model.draft.variant), cfg.objective, cfg.model.draft)


def variant_of_export(cfg: dict) -> Variant:
    """The variant an export's config.json declares by its architecture (the engines read the same); an
    architecture no variant claims is the plain DFlash drafter's (z-lab's exports name DFlashDraftModel).
    Variants of one architecture differ by `dflash_config.projector_type`, as SGLang tells them apart
    (Domino: DFlashDraftModel with projector_type "domino", whatever the architecture says)."""
    archs = cfg.get("architectures") or []
    projector = (cfg.get("dflash_config") or {}).get("projector_type")
    if projector is not None:
        for v in VARIANTS.values():
            if v.projector_type == projector:
                return v
    return next((v for v in VARIANTS.values() if v.architecture in archs and v.projector_type is None),
                VARIANTS["dflash"])


__all__ = ["VARIANTS", "LossChunk", "LossWeights", "RunProgress", "Variant", "accepted_lengths", "check_objective",
           "check_trains", "variant_of", "variant_of_export"]
