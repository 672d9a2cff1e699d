"""Issue 36, cases 18 and 19, for bench.learning: bad flag values, a bad --json path and a key a variant
refuses end in exit 2 naming them before any feature capture or training; the feature cache is written
atomically (a full disk leaves no cut file under its name) and a damaged one is captured again, not
loaded."""
from __future__ import annotations

import errno
import logging

import numpy as np
import pytest
import torch

from dflash_dist.bench import learning
from dflash_dist.config import load_config
from dflash_dist.data.disk import open_dataset, write_dataset
from dflash_dist.models.build import build_target, draft_spec

VOCAB = 64
TINY = ["model.target.kind=tiny", f"model.target.vocab_size={VOCAB}", "objective.block_size=4",
        "objective.num_anchors=8", "plan.token_budget=256"]


def corpus(n: int = 12, length: int = 20):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield rng.integers(VOCAB, size=length).astype(np.int64), (np.arange(length) >= 4).astype(np.uint8)


@pytest.fixture
def data(tmp_path):
    return write_dataset(tmp_path / "ds", corpus(), vocab_size=VOCAB)


@pytest.fixture
def no_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target was built: the bad input was not refused first")
    monkeypatch.setattr(learning, "build_target", refuse)


@pytest.mark.parametrize("flag, value", [("--heldout", "0"), ("--heldout", "x"), ("--epochs", "-1"),
                                         ("--eval-anchors", "0"), ("--threads", "-2"), ("--sizes", "4,a"),
                                         ("--sizes", "0")])
def test_a_bad_flag_value_exits_2_naming_it_before_any_work(data, no_work, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        learning.main(["--config", "", "--data", str(data), "--heldout", "4", flag, value, *TINY])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_a_json_path_that_cannot_be_written_exits_2_naming_the_flag(tmp_path, data, no_work, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        learning.main(["--config", "", "--data", str(data), "--heldout", "4", "--json",
                       str(tmp_path / "file" / "missing" / "out.json"), *TINY])
    assert exc.value.code == 2 and "--json" in capsys.readouterr().err


def test_a_key_one_variant_refuses_exits_2_before_the_first_variant_trains(data, no_work, capsys):
    with pytest.raises(SystemExit) as exc:
        learning.main(["--config", "", "--data", str(data), "--heldout", "4", "--variants", "dflash,dflash2",
                       *TINY, "variant.conv_kernel_size=9"])
    assert exc.value.code == 2 and "variant.conv_kernel_size" in capsys.readouterr().err


@pytest.fixture
def no_capture(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("features were captured: the key was not checked against the target first")
    monkeypatch.setattr(learning, "capture_all", refuse)


@pytest.mark.parametrize("variants, key, value", [
    ("dflash,dflash2", "variant.conv_group_size", "48"),  # does not divide the target's hidden 64
    ("dflash,dflash2", "variant.selector_top_k", str(VOCAB + 1)),  # above the target's vocabulary
    ("dflash", "model.draft.target_layer_ids", "[1,14,27]"),  # outside the 6-layer target
    ("dflash,dspark", "variant.ce_weight", "0"),  # with the other two 0: nothing trained
])
def test_a_key_checked_against_the_target_exits_2_before_any_capture(data, no_capture, capsys, variants, key,
                                                                      value):
    """Issue 46, cases 2 and 3 (and 1): training's own checks against the target, for every variant,
    before the features are captured (not a traceback after the first variant trained)."""
    extra = ["variant.l1_weight=0", "variant.confidence_weight=0"] if "dspark" in variants else []
    with pytest.raises(SystemExit) as exc:
        learning.main(["--config", "", "--data", str(data), "--heldout", "4", "--variants", variants,
                       *TINY, f"{key}={value}", *extra])
    assert exc.value.code == 2 and key in capsys.readouterr().err


@pytest.fixture
def capture(data, tmp_path, monkeypatch):
    """capture_all on a tiny target, counting the target's capture calls."""
    cfg = load_config(overrides=TINY)
    target = build_target(cfg, torch.device("cpu"))
    ds, layers = open_dataset(data), draft_spec(cfg, target).target_layer_ids
    calls, real = [], target.capture
    monkeypatch.setattr(target, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = tmp_path / "cache" / "features.pt"
    return (lambda: learning.capture_all(target, ds, layers, cache, cfg.objective, final=False)), cache, calls


@pytest.mark.parametrize("damage", ["cut", "garbage", "wrong samples"])
def test_a_damaged_cache_is_captured_again_not_loaded(capture, caplog, damage):
    run, cache, calls = capture
    first = run()
    n = len(calls)
    if damage == "cut":
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    elif damage == "garbage":
        cache.write_bytes(b"not a torch file")
    else:
        torch.save(first[:-1], cache)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.bench.learning"):
        again = run()
    assert len(calls) > n and "damaged" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(again) == len(first)
    assert len(torch.load(cache)) == len(first)  # rewritten whole
    run()
    assert len(calls) == 2 * n  # and loaded from then on


def test_a_full_disk_leaves_no_cut_cache_and_the_run_goes_on(capture, monkeypatch, caplog):
    run, cache, _ = capture
    real = torch.save

    def full_disk(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.bench.learning"):
        feats = run()
    assert feats and "not cached" in caplog.text
    assert list(cache.parent.iterdir()) == []  # neither a cut file under the name nor a temporary
    monkeypatch.setattr(torch, "save", real)
    assert len(run()) == len(feats) and cache.is_file()
