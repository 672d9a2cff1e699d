import pytest

from dflash_dist.config import ConfigError, default_target_layer_ids, load_config, loss_gamma


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
