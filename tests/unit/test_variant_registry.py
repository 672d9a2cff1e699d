"""The variant registry as the one place that knows variant names (issue 45): config.py names none and
asks the registry's rule (`config.add_rule`), a variant from outside the package registers through
DFLASH_VARIANTS=module:Class, and every bad entry is a ConfigError naming the variable and the entry."""
from __future__ import annotations

import pytest

from dflash_dist.config import ConfigError, load_config
from dflash_dist.models.variants import VARIANTS, Variant, _load_plugins, check_labels, register


class Elsewhere(Variant):
    name = "elsewhere"


@pytest.fixture
def registry():
    before = dict(VARIANTS)
    yield VARIANTS
    VARIANTS.clear()
    VARIANTS.update(before)


def test_a_variant_registered_by_its_import_path_is_one_the_config_accepts(registry):
    with pytest.raises(ConfigError, match="'model.draft.variant': 'elsewhere' is not one of"):
        load_config(overrides=["model.draft.variant=elsewhere"])
    _load_plugins(f" {__name__}:Elsewhere ,")
    assert isinstance(registry["elsewhere"], Elsewhere)
    assert load_config(overrides=["model.draft.variant=elsewhere"]).model.draft.variant == "elsewhere"


@pytest.mark.parametrize("entry, says", [("no_colon", "is not module:Class"), (":Cls", "is not module:Class"),
                                         ("dflash_dist.no_such_module:X", "No module named"),
                                         (f"{__name__}:Missing", "has no attribute 'Missing'")])
def test_a_bad_entry_names_the_variable_and_the_entry(registry, entry, says):
    with pytest.raises(ConfigError, match=f"DFLASH_VARIANTS: entry '{entry}'.*{says}"):
        _load_plugins(entry)


def test_a_taken_name_or_a_non_variant_is_refused(registry):
    class Impostor(Variant):
        name = "dspark"

    with pytest.raises(ConfigError, match="DFLASH_VARIANTS: variant name 'dspark' is taken by DSpark"):
        register(Impostor())
    with pytest.raises(ConfigError, match="is not a models.variants.base.Variant"):
        register(object())
    assert register(registry["dspark"]) is registry["dspark"]  # the same object again is no conflict


class DataOnly(Variant):
    """A variant whose term trains on the data's tokens only, with no rule of its own on the labels."""
    name = "data_only"
    labels = ("data",)


def test_the_declared_labels_are_checked_naming_the_key_and_the_values(registry):
    register(DataOnly())
    assert load_config(overrides=["model.draft.variant=data_only"]).objective.labels == "data"
    with pytest.raises(ConfigError, match="'objective.labels': 'target_argmax' with model.draft.variant=data_only, "
                                          "which trains on data only"):
        load_config(overrides=["model.draft.variant=data_only", "objective.labels=target_argmax"])
    with pytest.raises(ConfigError, match="'objective.labels': 'target_argmax' with model.draft.variant=dspark, "
                                          "which trains on data only"):
        check_labels(VARIANTS["dspark"], "target_argmax")
    with pytest.raises(ConfigError, match="'target_soft' with model.draft.variant=domino, which trains on data or "
                                          "target_full only"):
        check_labels(VARIANTS["domino"], "target_soft")
    # the plain head's loss takes every label mode; the variants' own, more specific messages come first
    assert VARIANTS["dflash"].labels == VARIANTS["dflash2"].labels == ("data", "target_argmax", "target_soft",
                                                                       "target_full")
    with pytest.raises(ConfigError, match="whose loss distils the target's whole distribution already"):
        load_config(overrides=["model.draft.variant=dspark", "objective.labels=target_argmax"])


def test_the_step_settings_refuse_labels_the_variant_does_not_declare():
    """A benchmark's or a test's settings, built without a loaded config's rules: refused by the same
    declared value."""
    from dataclasses import replace

    import helpers

    from dflash_dist.training.step import step_settings
    spec = helpers.tiny_spec(variant="dspark", markov_rank=6)
    cfg = helpers.config_of(block_size=spec.block_size)
    assert step_settings(cfg, spec).full is None
    with pytest.raises(ValueError, match="objective.labels=target_full: variant 'dspark' trains on data only"):
        step_settings(replace(cfg, objective=replace(cfg.objective, labels="target_full")), spec)


def test_a_variant_setting_a_retired_flag_is_refused(registry):
    """The step reads `Needs.head_loss` and `Variant.labels`: a class written against the old flags would
    have them silently ignored, so registering it is refused, naming what to declare instead."""
    class Old(Variant):
        name = "old"
        unary_loss = False

    class Older(Variant):
        name = "older"
        full_target_term = True

    with pytest.raises(ConfigError, match=r"'old' sets the retired unary_loss \(declare needs = Needs\(head_loss"):
        register(Old())
    with pytest.raises(ConfigError, match="'older' sets the retired full_target_term"):
        register(Older())
    assert "old" not in registry and "older" not in registry
