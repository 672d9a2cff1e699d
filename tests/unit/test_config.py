import pytest

from dflash_dist.config import ConfigError, _get, default_target_layer_ids, load_config, loss_gamma, ranges


def test_defaults_yaml_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("plan:\n  token_budget: 2048\ntrain:\n  epochs: 5\n")
    cfg = load_config(str(y), ["train.epochs=7", "model.draft.target_layer_ids=[1,2]"])
    assert cfg.plan.token_budget == 2048  # YAML over the schema
    assert cfg.train.epochs == 7  # key=value over the YAML
    assert cfg.model.draft.target_layer_ids == [1, 2]
    assert cfg.plan.max_seqs == 64  # schema default untouched


@pytest.mark.parametrize("override, key", [
    ("plan.token_bugdet=5", "plan.token_bugdet"),
    ("train.epochs=three", "train.epochs"),
    ("roles.mode=colocated_typo", "roles.mode"),
    ("objective.block_size=1", "objective.block_size"),
    ("plan.max_seqs=0", "plan.max_seqs"),
])
def test_bad_key_or_value_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_key_in_yaml_is_named(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(str(y))


def test_dflash_rules():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    cfg = load_config(None, [])
    assert loss_gamma(cfg.objective) == 7.0
    assert loss_gamma(load_config(None, ["objective.block_size=8"]).objective) == 4.0
    assert loss_gamma(load_config(None, ["objective.block_size=10"]).objective) == 5.0


# -- issue 19: every numeric key has a range, declared once on the schema, checked before any rank waits ---------

@pytest.mark.parametrize("override, said", [
    ("optim.min_lr_ratio=-1", "in [0, 1]"), ("optim.beta1=1.5", "in [0, 1)"), ("optim.beta2=1", "in [0, 1)"),
    ("optim.weight_decay=-1", ">= 0"), ("dist.timeout_s=inf", "> 0"), ("monitor.interval_s=inf", "> 0"),
    ("optim.grad_clip=nan", ">= 0"), ("train.checkpoint_every_min=nan", ">= 0"), ("objective.gamma=-1", ">= 0"),
    ("dist.device_memory_gib=-1", ">= 0"), ("optim.lr=inf", "> 0"), ("wandb.init_timeout_s=nan", "> 0"),
    ("dist.dead_after_s=0.005", ">= 1"), ("train.seed=-3", ">= 0"), ("train.eval_new_tokens=0", ">= 1"),
])
def test_a_value_outside_its_range_is_refused_naming_the_key_and_the_range(override, said):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"config key '{key}': must be a finite number {said}"), str(e.value)


def test_every_numeric_key_declares_its_range_in_the_schema():
    declared = ranges()
    assert declared and "optim.lr" in declared and "model.target.vocab_size" in declared
    assert [k for k, r in declared.items() if r is None] == []  # a new numeric key must say what it accepts
    cfg = load_config(None, [])
    assert all(r.allows(_get(cfg, k)) for k, r in declared.items()), "every default is within its range"


@pytest.mark.parametrize("overrides, key", [
    (["dist.heartbeat_s=1", "dist.dead_after_s=2"], "dist.dead_after_s"),  # fewer than 3 missed beats
    (["dist.timeout_s=16"], "dist.timeout_s"),  # gives up before the watchdog (15 s + 2 beats) can speak
    (["dist.heartbeat_s=0.001"], "dist.heartbeat_s"),
])
def test_liveness_windows_must_nest(overrides, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(None, overrides)
    load_config(None, ["dist.heartbeat_s=0.5", "dist.dead_after_s=3", "dist.timeout_s=60"])  # the tests' own
