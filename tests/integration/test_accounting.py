"""Wait/compute accounting against the truth: one stage made slow on purpose (a sleep inside the target's
capture or the drafter's step), 1 drafter + 1 target under torchrun. The truth comes from the calls the
wrapper itself times, independently of the code under test, on the same (possibly loaded) machine."""
import json
import os
import subprocess
import textwrap

import pytest
from helpers import TINY, TORCHRUN

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them

WRAPPER = textwrap.dedent('''
    import atexit, json, os, sys, time
    import dflash_dist.models.qwen3 as q
    import dflash_dist.roles.drafter as d
    import dflash_dist.roles.reporter as rep
    import dflash_dist.roles.target as t
    import dflash_dist.training.step as st
    slow_target, slow_drafter, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    seen = {}  # (start, end) of every call, by name

    def timed(name, fn, pause=0.0):
        def run(*a, **k):
            t0 = time.perf_counter()
            time.sleep(pause)
            try:
                return fn(*a, **k)
            finally:
                seen.setdefault(name, []).append((t0, time.perf_counter()))
        return run
    q.TinyQwen3.capture = timed("capture", q.TinyQwen3.capture, slow_target)  # the injected delays
    # the drafter's delay where its training steps call it (training.step.step_gradients), not the role's
    # module: since the one optimizer step moved there, a delay patched into roles.drafter slowed only the
    # warm-up, and the "slow" drafter waited for the target
    st.drafter_step = timed("step", st.drafter_step, slow_drafter)
    # What each role computes, as the roles count it: the target its capture_for_drafter; the drafter its
    # train_step less the wait for the packet (Inbox.take) and the reporter's record after the count.
    t.capture_for_drafter = timed("target_compute", t.capture_for_drafter)
    d.Drafter.train_step = timed("train_step", d.Drafter.train_step)
    d.Inbox.take = timed("take", d.Inbox.take)
    rep.Reporter.step = timed("report", rep.Reporter.step)
    atexit.register(lambda: open(f"{out}.{os.environ['RANK']}", "w").write(json.dumps(seen)))
    from dflash_dist.train import main
    sys.exit(main(sys.argv[4:]))
''')


def spent(calls: list) -> float:
    return sum(b - a for a, b in calls)


def run(tmp_path, slow_target, slow_drafter):
    script = tmp_path / "slow.py"
    script.write_text(WRAPPER)
    run_dir = tmp_path / f"run-{slow_target}-{slow_drafter}"
    cmd = TORCHRUN + ["--standalone", "--nproc_per_node=2", str(script), str(slow_target), str(slow_drafter),
                      str(tmp_path / "seen"), *TINY, f"train.run_dir={run_dir}", "train.epochs=1",
                      "data.synthetic.num_samples=300"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, json.loads((tmp_path / "seen.1").read_text()), json.loads((tmp_path / "seen.0").read_text())


def busy_shares(target: dict, drafter: dict) -> tuple[float, float]:
    """(target, drafter): the share of its time in the training loop each role computed, measured by the
    wrapper around the calls themselves: from a role's first batch to its last, and its compute as its
    calls' wall time on the same machine. A load that slows a role's own work (not only the injected
    sleeps) then slows both sides of the ratio alike; the stage times alone (the injected delays) would
    leave it out and drift from the truth under load (0.668 measured against 0.725 at load 10)."""
    tc = target["target_compute"][1:]  # [0]: the warm-up
    t_busy = spent(tc) / (tc[-1][1] - tc[0][0])
    steps = drafter["train_step"]
    d_busy = (spent(steps) - spent(drafter["take"]) - spent(drafter.get("report", []))) / (steps[-1][1] - steps[0][0])
    return t_busy, d_busy


@pytest.mark.parametrize("slow_target, slow_drafter", [(0.25, 0.05), (0.03, 0.25)])
def test_the_slow_side_makes_the_other_wait_and_only_it(tmp_path, slow_target, slow_drafter):
    """The waiting side's wait share in summary.json is the share of its time it did not compute (from
    the wrapper); the slow side hardly waits; the advice names it. The injected delays make the scenario:
    the fast side computes a fraction of the slow side's period, so it waits a clear part of it."""
    summary, target, drafter = run(tmp_path, slow_target, slow_drafter)
    t_busy, d_busy = busy_shares(target, drafter)
    waiting, idle = ("drafters", "targets") if slow_target > slow_drafter else ("targets", "drafters")
    truth = 1 - (d_busy if waiting == "drafters" else t_busy)
    stages = spent(target["capture"][1:]) / (len(target["capture"]) - 1), spent(drafter["step"]) / len(drafter["step"])
    print(f"slow {idle[:-1]}: {waiting} wait {summary['wait_' + waiting]:.3f} (truth {truth:.3f}; stages: target "
          f"{stages[0]:.3f} s, drafter {stages[1]:.3f} s), {idle} {summary['wait_' + idle]:.3f}")
    # the slow side's delay is most of the fast side's period: idle 0.7-0.8, 0.53 at load 10.8 (2 cores)
    assert truth > 0.3, truth
    assert abs(summary["wait_" + waiting] - truth) < 0.05, (summary["wait_" + waiting], truth)
    assert summary["wait_" + idle] < 0.05, summary["wait_" + idle]
    assert summary["balance"]["bottleneck"] == idle
