"""What the drafter's variant adds to the forecasts: its own object, asked through one registry.

Each variant declares its forecast terms as `Variant.forecast` (a `VariantForecast` of
`models/variants/forecast.py`, which says what its five questions ask; the built-ins' live in their
folders, `models/variants/<name>/forecast.py`), so the variant registry (`models.variants.VARIANTS`) is the
only list of them: a new variant, built in or registered from outside, adds nothing here. The memory model
(`forecast.memory`) and the cost model (`forecast.cost`) ask `forecast_of` without knowing which variant runs.
"""
from __future__ import annotations

from dflash_dist.config import Config, ConfigError
from dflash_dist.forecast.shapes import ModelShapes
from dflash_dist.models.variants import variant_of
from dflash_dist.models.variants.forecast import ChunkBytes, VariantForecast

DFlashForecast = VariantForecast  # the base class's name before it moved (issue 45), for its importers

__all__ = ["ChunkBytes", "DFlashForecast", "VariantForecast", "draft_param_count", "forecast_of"]


def forecast_of(cfg: Config) -> VariantForecast:
    """The forecast terms of `model.draft.variant`'s variant (an unknown name: the registry's ConfigError
    naming the key)."""
    name = cfg.model.draft.variant
    own = variant_of(name).forecast
    if not isinstance(own, VariantForecast):  # e.g. None, which once meant "this module's object"
        raise ConfigError(f"config key 'model.draft.variant': variant {name!r} declares no forecast terms "
                          f"(its Variant.forecast is {own!r}, not a models.variants.forecast.VariantForecast)")
    return own


def draft_param_count(s: ModelShapes, cfg: Config) -> int:
    """The drafter's parameters: the DFlash drafter's and its variant's own."""
    return s.draft_params + forecast_of(cfg).params(s, cfg)
