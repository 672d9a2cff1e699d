"""The variant registry as the one place that knows variant names (issue 45): config.py names none and
asks the registry's rule (`config.add_rule`), a variant from outside the package registers through
DFLASH_VARIANTS=module:Class, and every bad entry is a ConfigError naming the variable and the entry."""
from __future__ import annotations

import pytest

from dflash_dist.config import ConfigError, load_config
from dflash_dist.models.variants import VARIANTS, Variant, _load_plugins, register


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
