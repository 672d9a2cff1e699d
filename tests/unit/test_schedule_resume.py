"""A resume on another layout (another drafter count, so another total of optimizer steps): the learning
rate and Domino's lambda continue from where the checkpoint left them (issue 46, case 8: lambda rose
0.781 -> 0.855 and the learning rate jumped, unlogged), and what remains of both schedules ends at the new
total. On the same layout the resumed schedules are the uninterrupted run's, exactly."""
import logging

import pytest
import torch

from dflash_dist.config import load_config
from dflash_dist.models.variants.domino_loss import domino_lambda
from dflash_dist.parallel.sharding import Replicas
from dflash_dist.training.state import ScheduleClock, TrainState, lr_lambda

LR, F = 0.5, 0.5
CFG = load_config(overrides=["model.draft.variant=domino", f"optim.lr={LR}", f"variant.lambda_fraction={F}",
                             "optim.warmup_ratio=0.1", "optim.min_lr_ratio=0.1"])


def one_process(model):
    sharding = Replicas.__new__(Replicas)  # one process: no group to broadcast over
    sharding.model = model
    return sharding


def trained(total: int, steps: int) -> tuple[TrainState, dict]:
    model = torch.nn.Linear(3, 3)
    st = TrainState.create(model, CFG, total_steps=total)
    for _ in range(steps):
        st.optimizer.step()
        st.scheduler.step()
        st.totals.steps += 1
    return st, st.full_state(one_process(model))


def resumed(saved: dict, total: int) -> TrainState:
    model = torch.nn.Linear(3, 3)
    st = TrainState.create(model, CFG, total_steps=total)
    st.load(saved, one_process(model))
    return st


def lam(st: TrainState, steps: int) -> float:
    p = st.progress(steps)
    return domino_lambda(p.step, p.total, F)


def lr_after_step(st: TrainState) -> float:
    st.optimizer.step()
    st.scheduler.step()
    return st.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("new_total", [48, 20])  # fewer drafters (more steps), more drafters (fewer)
def test_the_schedules_continue_where_the_checkpoint_left_them(caplog, new_total):
    before, saved = trained(32, 8)
    lr8, lam8 = before.optimizer.param_groups[0]["lr"], lam(before, 8)
    assert lam8 == domino_lambda(8, 32, F) and lr8 == pytest.approx(LR * lr_lambda(32, 0.1, 0.1)(8))
    with caplog.at_level(logging.WARNING, logger="dflash_dist.training.state"):
        st = resumed(saved, new_total)
    assert "re-planned" in caplog.text and "another layout" in caplog.text
    assert st.optimizer.param_groups[0]["lr"] == pytest.approx(lr8, rel=1e-12)  # the next step's: unchanged
    assert lam(st, 8) == pytest.approx(lam8, rel=1e-12)
    lrs = [lr_after_step(st) for _ in range(new_total - 8)]
    lams = [lam(st, s) for s in range(8, new_total + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and all(a >= b for a, b in zip(lams, lams[1:]))  # no rise
    assert lrs[-1] == pytest.approx(LR * 0.1) and lams[-1] == 0.0  # both end at the new total
    assert st.clock.position(new_total) == pytest.approx(32)


def test_a_resume_on_the_same_layout_is_the_uninterrupted_run():
    whole, _ = trained(32, 0)
    expected = [lr_after_step(whole) for _ in range(32)]
    _, saved = trained(32, 8)
    st = resumed(saved, 32)
    assert st.clock == ScheduleClock(32, 32)
    assert [lr_after_step(st) for _ in range(24)] == expected[8:]  # exactly
    assert [lam(st, s) for s in range(8, 33)] == [domino_lambda(s, 32, F) for s in range(8, 33)]


def test_two_resumes_compose():
    _, saved = trained(32, 8)
    st = resumed(saved, 48)
    for _ in range(10):
        lr_after_step(st)
        st.totals.steps += 1
    lr18, lam18 = st.optimizer.param_groups[0]["lr"], lam(st, 18)
    again = resumed(st.full_state(one_process(st.model)), 40)
    assert again.optimizer.param_groups[0]["lr"] == pytest.approx(lr18, rel=1e-12)
    assert lam(again, 18) == pytest.approx(lam18, rel=1e-12) and again.clock.position(40) == pytest.approx(32)


def test_a_checkpoint_without_its_schedule_says_it_is_planned_anew(caplog):
    _, saved = trained(32, 8)
    del saved["schedule"]
    with caplog.at_level(logging.WARNING, logger="dflash_dist.training.state"):
        st = resumed(saved, 48)
    assert "planned anew over 48 steps" in caplog.text and st.clock == ScheduleClock(48, 48)
