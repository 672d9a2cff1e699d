"""A diverging run under torchrun (3 ranks, gloo): exit 4 with no non-finite state written, periodic
checkpoints that keep no exploded weights (and the way out), a run that skips most of its steps."""
import json
import re

import pytest
import torch
from helpers import exit_codes, torchrun

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them


def test_a_diverging_run_stops_with_exit_4_and_writes_no_nonfinite_state(tmp_path):
    res = torchrun(3, ["optim.lr=1e30", "train.epochs=1", "train.max_nonfinite_steps=3"], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert re.search(r"exitcode\s*:\s*4", out), out[-3000:]
    assert len(re.findall(r"step \d+ skipped: loss sum \S+, gradient norm \S+ \(\d of at most 3", out)) == 3, out[-3000:]
    assert "training diverged: 3 steps with a non-finite loss or gradient norm" in out
    assert not (tmp_path / "export").exists() and not list((tmp_path / "checkpoints").glob("step-*"))
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["kind"] == "diverged" and last["skipped_steps"] == 3 and last["grad_norm"] is None  # NaN -> null


# -- issue 19: diverged checkpoints, roll-backs and requeues, changed data, a read-only export ---------------------


def test_periodic_checkpoints_of_a_diverging_run_keep_no_exploded_weights_and_the_way_out_works(tmp_path):
    job = ["train.epochs=1", "train.checkpoint_every_steps=1", "train.keep_last=2"]
    res = torchrun(3, job + ["optim.lr=1e30"], tmp_path)
    out = res.stdout + res.stderr
    assert 4 in exit_codes(out), out[-3000:]
    assert "no checkpoint of this run is known to be good: start over with train.resume=none and a lower optim.lr" \
        in out, out[-3000:]
    assert not list((tmp_path / "checkpoints").glob("step-*")), "nothing auto could resume into the divergence"
    (aside,) = (tmp_path / "checkpoints" / "set-aside").glob("diverged-*")
    (exploded,) = aside.glob("step-*")  # written after the one finite step, whose weights then gave NaN
    assert max(v.abs().max() for v in torch.load(exploded / "drafter.pt")["drafter"].values()) > 1e20
    res = torchrun(3, job + ["optim.lr=1e-2"], tmp_path)  # the same command with a sane lr (auto)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_nonfinite_steps"] == 0


def test_a_run_that_skips_most_of_its_steps_is_diverged_and_exports_nothing(tmp_path):
    res = torchrun(3, ["optim.lr=1e30", "train.epochs=1", "train.max_nonfinite_steps=1000"], tmp_path)
    out = res.stdout + res.stderr
    assert 4 in exit_codes(out), out[-3000:]
    assert re.search(r"training diverged: the last step \(12\) was skipped for a non-finite loss or gradient norm "
                     r"\(11 of 12 steps skipped; the last finite one was step 1\)", out), out[-3000:]
    assert not (tmp_path / "export").exists() and not (tmp_path / "summary.json").exists()
    assert not list((tmp_path / "checkpoints").glob("step-*"))


