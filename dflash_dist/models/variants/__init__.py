"""The registry of DFlash-family drafter variants (`model.draft.variant`); the interface is `base.Variant`.

A variant outside this package registers itself by its import path in the environment variable
DFLASH_VARIANTS ("module:Class", comma-separated), read once when this registry is first imported. An
environment variable, not a config key: the registry must know every name before a config is validated
(the name is checked against it) and where no config exists at all (an export loaded by
`dflash_dist.evaluate` is told apart by its architecture), and torchrun hands the environment to every
rank it spawns, so each process sees the same registry (tests/integration/test_toy_variant.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import os

from dflash_dist.config import ConfigError, add_aliases, add_rule, parse_section
from dflash_dist.models.variants.base import (
    BlockLayout,
    Figures,
    LossChunk,
    LossWeights,
    Needs,
    NoOptions,
    RunProgress,
    Variant,
    accepted_lengths,
    check_trains,
)
from dflash_dist.models.variants.dflash import DFlash
from dflash_dist.models.variants.dflash2 import DFlash2
from dflash_dist.models.variants.domino import Domino
from dflash_dist.models.variants.dspark import DSpark

VARIANTS: dict[str, Variant] = {}
PLUGINS_ENV = "DFLASH_VARIANTS"
# Flags of earlier issues that declared values replaced, and what to declare instead.
_RETIRED = {"unary_loss": "needs = Needs(head_loss=...)", "full_target_term": "labels = (..., 'target_full')"}


def register(variant: Variant) -> Variant:
    """Add a variant to the registry under its `name` (a name taken is refused: two variants under one
    name would train one and export the other)."""
    if not isinstance(variant, Variant):
        raise ConfigError(f"{PLUGINS_ENV}: {variant!r} is not a models.variants.base.Variant")
    stale = [f"{k} (declare {v})" for k, v in _RETIRED.items()
             if any(k in vars(c) for c in type(variant).__mro__ if c is not Variant)]
    if stale:  # the step reads the declared values: a class setting the old flag would be silently ignored
        raise ConfigError(f"{PLUGINS_ENV}: variant {variant.name!r} sets the retired {', '.join(stale)}")
    if VARIANTS.get(variant.name, variant) is not variant:
        raise ConfigError(f"{PLUGINS_ENV}: variant name {variant.name!r} is taken by "
                          f"{type(VARIANTS[variant.name]).__name__}")
    VARIANTS[variant.name] = variant
    add_aliases(variant.name, variant.old_keys)  # its options' keys before the `variant` section
    return variant


def _load_plugins(spec: str) -> None:
    """Register each "module:Class" of `spec` (DFLASH_VARIANTS), a ConfigError naming the entry at fault."""
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        module, _, cls = entry.partition(":")
        if not module or not cls:
            raise ConfigError(f"{PLUGINS_ENV}: entry {entry!r} is not module:Class")
        try:
            register(getattr(importlib.import_module(module), cls)())
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{PLUGINS_ENV}: entry {entry!r}: {exc}") from exc


def variant_of(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(f"config key 'model.draft.variant': {name!r} is not one of "
                          f"{', '.join(VARIANTS)}") from None


def options_for(variant: Variant, section):
    """`variant`'s options, typed (its `Options` value), from a config's `variant` section: a mapping as
    loaded, its Options value as validated, or another variant's value (its fields by name: DFlash's has
    none, so a config loaded for DFlash gives another variant its defaults). A ConfigError names the key
    `variant.<name>` at fault."""
    if type(section) is variant.Options:
        return section
    return parse_section(variant.Options, section, "variant", f"model.draft.variant={variant.name}")


def options_of(cfg):
    """The options of the variant the config names (model.draft.variant), typed."""
    return options_for(variant_of(cfg.model.draft.variant), cfg.variant)


def with_variant(cfg, name: str, **options):
    """A copy of `cfg` that trains variant `name` with these options (the rest its defaults), its `variant`
    section typed as a loaded config's is: what a benchmark comparing variants on one config builds."""
    v = variant_of(name)
    draft = dataclasses.replace(cfg.model.draft, variant=name)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, draft=draft),
                               variant=parse_section(v.Options, options, "variant", f"model.draft.variant={name}"))


def check_config(cfg) -> None:
    """The registry's rule on every loaded config (`config.validate` runs it; added below): the name is a
    registered variant's, its `variant` section that variant's options (made its typed value here, checked,
    defaults filled, so the config records every option), that variant's own rules (`check_config`), then
    the rules on its declared values: the labels it trains on (`Variant.labels`; after its own rules, whose
    more specific messages win)."""
    v = variant_of(cfg.model.draft.variant)
    cfg.variant = parse_section(v.Options, cfg.variant, "variant", f"model.draft.variant={v.name}")
    v.check_config(cfg)
    check_labels(v, cfg.objective.labels)


def check_labels(variant: Variant, labels: str) -> None:
    """A ConfigError naming objective.labels when `variant` does not declare `labels` among those it
    trains on (`Variant.labels`)."""
    if labels not in variant.labels:
        raise ConfigError(f"config key 'objective.labels': {labels!r} with model.draft.variant={variant.name}, "
                          f"which trains on {' or '.join(variant.labels)} only")


def check_objective(cfg) -> None:
    """The variant's rules on a loaded config that need no target (config.py names no variant, so they
    run here: `train.main` right after loading, before any group forms, and `models.build.draft_spec`
    for every tool that builds a drafter): its loss weights train something (`base.check_trains`)."""
    check_trains(variant_of(cfg.model.draft.variant), cfg.objective, options_of(cfg))


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


for _builtin in (DFlash(), DFlash2(), DSpark(), Domino()):
    register(_builtin)
_load_plugins(os.environ.get(PLUGINS_ENV, ""))  # last: a plugin imports this package's names above
add_rule(check_config)

__all__ = ["PLUGINS_ENV", "VARIANTS", "BlockLayout", "Figures", "LossChunk", "Needs", "LossWeights", "NoOptions",
           "RunProgress", "Variant", "accepted_lengths", "check_config", "check_labels", "check_objective",
           "check_trains", "options_for", "options_of", "register", "variant_of", "variant_of_export", "with_variant"]
