"""The metric sinks (observe.monitor.Sinks): valid JSON with NaN as null, a full disk turns the JSONL sink
off with one warning, wandb's mode from the environment, wandb rows never overwritten."""
import json
import logging
import os

import numpy as np
import pytest
from helpers import wandb_cfg

from dflash_dist.io.files import write_json


def _strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}"))


def test_summary_json_is_valid_json_with_nan_as_null(tmp_path):
    f = tmp_path / "summary.json"
    f.write_text("old")
    write_json(f, {"final_loss": float("nan"), "acc": [float("inf"), 0.5, -float("inf")], "n": 3,
                   "epochs": [{"loss": np.float64("nan")}], "tau": None, "t": (1.0, float("nan"))})
    assert _strict(f.read_text()) == {"final_loss": None, "acc": [None, 0.5, None], "n": 3,
                                      "epochs": [{"loss": None}], "tau": None, "t": [1.0, None]}
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary left


def test_a_full_disk_turns_the_jsonl_sink_off_with_one_warning(tmp_path, caplog):
    from dflash_dist.observe.monitor import Sinks
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")  # every write: ENOSPC
    sinks = Sinks(tmp_path, wandb_cfg("disabled"), {})
    with caplog.at_level(logging.WARNING, logger="dflash_dist.observe.monitor"):
        for step in range(3):
            sinks.write({"kind": "note", "step": step}, console=False)
    sinks.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["metrics.jsonl: write failed ([Errno 28] No space left on device): JSONL metrics are off "
                        "for the rest of the run, training goes on"]
    assert sinks.jsonl is None


def test_jsonl_records_are_valid_json(tmp_path):
    from dflash_dist.observe.monitor import Sinks
    sinks = Sinks(tmp_path, wandb_cfg("disabled"), {})
    sinks.write({"kind": "progress", "step": 1, "loss": float("nan"), "eta_s": float("inf")}, console=False)
    sinks.close()
    assert _strict((tmp_path / "metrics.jsonl").read_text()) == {"kind": "progress", "step": 1, "loss": None,
                                                                 "eta_s": None}


def test_wandb_mode_from_the_environment_overrides_the_config(tmp_path, wandb_env):
    from dflash_dist.observe.monitor import Sinks, wandb_mode
    assert wandb_mode("online") == "online"
    wandb_env.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("offline") == "disabled"
    assert Sinks(tmp_path, wandb_cfg("offline"), {}).wandb is None
    wandb_env.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode("online") == "offline"
    wandb_env.setenv("WANDB_MODE", "bogus")
    assert wandb_mode("online") == "online"


class FakeRun:
    def __init__(self):
        self.rows, self.summary = [], {}

    def log(self, data, step):
        self.rows.append((step, data["loss"]))


def test_wandb_rows_are_never_overwritten_by_a_repeated_or_earlier_step(tmp_path):
    from dflash_dist.observe.monitor import Sinks
    sinks = Sinks(tmp_path, wandb_cfg("disabled"), {})
    sinks.wandb = FakeRun()
    for kind, step, loss in [("progress", 4, 1.0), ("progress", 4, 2.0), ("epoch_end", 4, 3.0), ("progress", 6, 4.0),
                             ("progress", 5, 5.0), ("stopped", 6, 6.0), ("progress", 7, 7.0)]:
        sinks.write({"kind": kind, "step": step, "loss": loss}, console=False)
    sinks.write({"kind": "summary", "final_loss": 0.5}, console=False)
    assert sinks.wandb.rows == [(4, 1.0), (6, 4.0), (7, 7.0)]
    assert sinks.wandb.summary == {"epoch_end/step": 4, "epoch_end/loss": 3.0, "stopped/step": 6,
                                   "stopped/loss": 6.0, "summary/final_loss": 0.5}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8  # JSONL keeps every record
    sinks.wandb = None
    sinks.close()
