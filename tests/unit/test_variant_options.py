"""Issue 45, item 1: a variant's options are one typed section of the config, `variant.<option>`, declared
by the variant (`Variant.Options`; `Variant.Model` the part the drafter's spec carries and its export writes),
checked as the schema's keys are right after loading; the keys they had before (`model.draft.markov_rank`,
`objective.dspark_l1_weight`, ...) are taken as their new key, and a checkpoint's config written before
reads in today's form."""
from __future__ import annotations

import dataclasses

import helpers
import pytest

from dflash_dist.checkpoints.store import check_resumable, config_differences
from dflash_dist.config import ConfigError, load_config, ranges, to_dict, upgrade_dict
from dflash_dist.models.variants import VARIANTS

NAMES = sorted(VARIANTS)
# Options away from their defaults, model and loss knobs both, so a run's own values are what is compared.
OWN = {"dflash2": ["variant.selector_rank=16", "variant.selector_weight=0.5"],
       "dspark": ["variant.markov_rank=8", "variant.l1_weight=0.5"],
       "domino": ["variant.gru_hidden_dim=12", "variant.lambda_fraction=0.5"]}


def other_value(f: dataclasses.Field):
    """A value of option `f` other than its default, inside its range (a one-value choice: that value)."""
    d = f.default
    if isinstance(d, bool):
        return not d
    if isinstance(d, int):
        return d + 1
    if isinstance(d, float):
        return d / 2 if d > 0 else 2.0
    return d


@pytest.mark.parametrize("name", NAMES)
def test_every_option_is_typed_and_ranged_and_its_defaults_load(name):
    v = VARIANTS[name]
    assert issubclass(v.Options, v.Model) and dataclasses.is_dataclass(v.Options)
    assert [k for k, r in ranges(v.Options).items() if r is None] == []  # every numeric option says what it takes
    cfg = load_config(overrides=[f"model.draft.variant={name}"])
    assert cfg.variant == v.Options() and to_dict(cfg)["variant"] == dataclasses.asdict(v.Options())
    for f in dataclasses.fields(v.Options):
        cfg = load_config(overrides=[f"model.draft.variant={name}", f"variant.{f.name}={other_value(f)}"])
        assert getattr(cfg.variant, f.name) == other_value(f)


@pytest.mark.parametrize("name", [n for n in NAMES if VARIANTS[n].old_keys])
def test_each_old_key_is_taken_as_its_new_key(name):
    v = VARIANTS[name]
    fields = {f.name: f for f in dataclasses.fields(v.Options)}
    assert set(v.old_keys.values()) == set(fields)  # every option had a key before; each is mapped
    for old, new in v.old_keys.items():
        value = other_value(fields[new])
        cfg = load_config(overrides=[f"model.draft.variant={name}", f"{old}={value}"])
        assert getattr(cfg.variant, new) == value, old
        same = load_config(overrides=[f"model.draft.variant={name}", f"{old}={value}", f"variant.{new}={value}"])
        assert same.variant == cfg.variant
        if value != fields[new].default:
            with pytest.raises(ConfigError, match=f"'{old}': is 'variant.{new}' now, and both are given"):
                load_config(overrides=[f"model.draft.variant={name}", f"{old}={value}",
                                       f"variant.{new}={fields[new].default}"])


def test_an_old_key_in_a_yaml_file_is_taken_too(tmp_path):
    (tmp_path / "c.yaml").write_text("model:\n  draft:\n    variant: dspark\n    markov_rank: 8\n"
                                     "objective:\n  dspark_l1_weight: 0.5\n")
    cfg = load_config(str(tmp_path / "c.yaml"), ["variant.ce_weight=0.2"])
    assert (cfg.variant.markov_rank, cfg.variant.l1_weight, cfg.variant.ce_weight) == (8, 0.5, 0.2)


@pytest.mark.parametrize("overrides, said", [
    (["model.draft.markov_rank=8"],
     "config key 'model.draft.markov_rank': an option of model.draft.variant=dspark (now 'variant.markov_rank'), "
     "and model.draft.variant is dflash"),
    (["model.draft.variant=domino", "objective.selector_weight=0.5"],
     "config key 'objective.selector_weight': an option of model.draft.variant=dflash2"),
    (["model.draft.variant=dspark", "variant.gru_hidden_dim=8"],
     "config key 'variant.gru_hidden_dim': not an option of model.draft.variant=dspark (its options: markov_rank"),
    (["variant.markov_rank=8"], "config key 'variant.markov_rank': not an option of model.draft.variant=dflash "
                                "(its options: none)"),
    (["model.draft.variant=dspark", "variant.markov_rank=0"], "config key 'variant.markov_rank': must be a finite "
                                                              "number >= 1, got 0"),
    (["model.draft.variant=dspark", "variant.markov_rank=abc"], "config key 'variant.markov_rank': Value 'abc'"),
    (["model.draft.variant=dspark", "variant.markov_head_type=x"], "config key 'variant.markov_head_type': 'x' is "
                                                                   "not one of ('vanilla',)"),
    (["model.draft.variant=domino", "variant.lambda_fraction=1.5"], "config key 'variant.lambda_fraction': must be"),
])
def test_a_bad_option_is_refused_naming_its_key(overrides, said):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert str(e.value).startswith(said), str(e.value)


def flat_config(cfg) -> dict:
    """`cfg` as a config dict of before the `variant` section: every variant's knobs flat under model.draft
    and objective, at their defaults, the run's own at its value (as `to_dict` wrote it then)."""
    d = to_dict(cfg)
    own = d.pop("variant")
    for v in VARIANTS.values():
        defaults = dataclasses.asdict(v.Options())
        for old, new in v.old_keys.items():
            section, key = old.rsplit(".", 1)
            node = d
            for part in section.split("."):
                node = node[part]
            node[key] = own[new] if v.name == cfg.model.draft.variant else defaults[new]
    return d


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_config_of_before_reads_as_today_and_resumes(name, tmp_path):
    cfg = load_config(overrides=[f"model.draft.variant={name}", *OWN.get(name, [])])
    old = flat_config(cfg)
    assert upgrade_dict(old).get("variant", {}) == to_dict(cfg)["variant"]
    assert config_differences(old, to_dict(cfg)) == []
    meta = {"config": old, "cursor": {"epoch": 0, "batch": 0}}
    check_resumable(meta, cfg, tmp_path)  # no refusal: the same setup
    if name == "dflash":
        return
    first = dataclasses.fields(VARIANTS[name].Options)[0]
    changed = load_config(overrides=[f"model.draft.variant={name}", *OWN.get(name, []),
                                     f"variant.{first.name}={other_value(first) + 1}"])
    assert [d.split(":")[0] for d in config_differences(old, to_dict(changed))] == [f"variant.{first.name}"]
    with pytest.raises(ConfigError, match=f"variant.{first.name}"):
        check_resumable(meta, changed, tmp_path)


def test_the_spec_carries_the_model_part_of_the_options():
    dspark = VARIANTS["dspark"]
    spec = helpers.tiny_spec(variant="dspark", markov_rank=6)
    assert type(spec.options) is dspark.Model and spec.options.markov_rank == 6
    opts = dspark.Options(markov_rank=5, l1_weight=0.3)  # loss knobs are not the drafter's
    assert dataclasses.replace(spec, options=opts).options == dspark.Model(markov_rank=5)
    assert dataclasses.replace(spec, variant="dflash2").options == VARIANTS["dflash2"].Model()  # its defaults
    assert helpers.tiny_spec().options == VARIANTS["dflash"].Model()


@pytest.mark.parametrize("name", NAMES)
def test_with_variant_gives_a_config_its_forecasts_read(name):
    """A benchmark comparing variants on one loaded config switches the variant with its typed options
    (`with_variant`); the forecasts then read that variant's options (gpu_check's variants section once
    set the name alone and the forecasts met DFlash's empty options)."""
    from dflash_dist.forecast.shapes import model_shapes
    from dflash_dist.forecast.variants import draft_param_count
    from dflash_dist.models.variants import with_variant
    base = load_config(overrides=["model.draft.num_layers=2"])
    cfg = with_variant(base, name)
    direct = load_config(overrides=["model.draft.num_layers=2", f"model.draft.variant={name}"])
    assert cfg == direct and draft_param_count(model_shapes(cfg), cfg) == draft_param_count(model_shapes(direct), direct)
    with pytest.raises(ConfigError, match="'variant.nope': not an option"):
        with_variant(base, name, nope=1)
