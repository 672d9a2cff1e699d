"""Issue 46, case 1: one rule for every variant's loss weights. Each variant declares the keys that weigh
its loss (`Variant.loss_weights`); a config under which all of them are 0 and no unweighted term is
left trains nothing and is refused naming the keys (`check_objective`, which training runs right after
loading the config and `draft_spec` runs for every tool that builds a drafter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash_dist.config import ConfigError, load_config
from dflash_dist.models.build import build_target, draft_spec
from dflash_dist.models.variants import VARIANTS, check_objective

DSPARK = ["model.draft.variant=dspark"]
ZERO_DSPARK = ["variant.ce_weight=0", "variant.l1_weight=0", "variant.confidence_weight=0"]
FULL_ZERO = ["objective.labels=target_full", "objective.distill_kl_weight=0", "objective.distill_l1_weight=0"]


def refusal(overrides: list[str]) -> str:
    cfg = load_config(overrides=overrides)
    with pytest.raises(ConfigError) as exc:
        check_objective(cfg)
    with pytest.raises(ConfigError, match="nothing would be trained"):  # every tool's drafter build alike
        draft_spec(cfg, build_target(cfg, torch.device("cpu")))
    return str(exc.value)


def test_dspark_with_its_three_weights_zero_is_refused_naming_them():
    msg = refusal(DSPARK + ZERO_DSPARK)
    for key in ("variant.ce_weight", "variant.l1_weight", "variant.confidence_weight"):
        assert f"'{key}'" in msg
    assert "nothing would be trained" in msg


def test_dspark_without_its_confidence_head_and_the_other_two_zero_is_refused():
    msg = refusal(DSPARK + ["variant.enable_confidence_head=false", "variant.ce_weight=0",
                            "variant.l1_weight=0"])  # the confidence weight (1.0) weighs no term
    assert "'variant.ce_weight'" in msg and "'variant.l1_weight'" in msg
    assert "confidence_weight" not in msg and "enable_confidence_head" in msg


@pytest.mark.parametrize("one", ["variant.ce_weight=0.1", "variant.l1_weight=0.1",
                                 "variant.confidence_weight=0.1"])
def test_dspark_with_any_one_term_weighted_trains(one):
    check_objective(load_config(overrides=DSPARK + ZERO_DSPARK + [one]))


@pytest.mark.parametrize("variant", ["dflash", "domino"])
def test_target_full_with_both_weights_zero_is_the_same_rule(variant):
    msg = refusal(FULL_ZERO + [f"model.draft.variant={variant}"])
    assert "'objective.distill_kl_weight' and 'objective.distill_l1_weight'" in msg and "target_full" in msg


def test_dflash2_counts_its_selector_term_among_its_weights():
    msg = refusal(FULL_ZERO + ["model.draft.variant=dflash2", "variant.selector_weight=0"])
    assert "'variant.selector_weight'" in msg and "'objective.distill_kl_weight'" in msg
    # the selector term alone trains (the selector and, undetached, the backbone) on the target's top-1
    check_objective(load_config(overrides=FULL_ZERO + ["model.draft.variant=dflash2"]))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_declares_its_weights_and_trains_at_its_defaults(name):
    """The contract over the registry: the defaults train; under data labels a term no key weighs (the
    plain or Domino's cross-entropy) trains whatever the other keys say, except DSpark's, all weighted."""
    v = VARIANTS[name]
    for labels in ("data", "target_full"):
        if name == "dspark" and labels == "target_full":
            continue  # refused by config for DSpark (its loss distils already)
        cfg = load_config(overrides=[f"model.draft.variant={name}", f"objective.labels={labels}"])
        w = v.loss_weights(cfg.objective, cfg.variant)
        assert w.trains() and all(k.startswith(("objective.", "variant.")) for k in w.keys)
        check_objective(cfg)
    own = {f.name for f in dataclasses.fields(v.Options)}  # its zero weights: the keys it has of these
    zero = [k for k in ["variant.selector_weight=0", *ZERO_DSPARK] if k.split("=")[0].removeprefix("variant.") in own]
    cfg = load_config(overrides=[f"model.draft.variant={name}", *zero])
    assert v.loss_weights(cfg.objective, cfg.variant).unweighted == (name != "dspark")
