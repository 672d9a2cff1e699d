"""Wait/compute accounting against the truth: one stage made slow on purpose (a sleep inside the target's
capture or the drafter's step), 1 drafter + 1 target under torchrun. The truth comes from the stage
durations the wrapper itself measures, independently of the code under test."""
import json
import os
import subprocess
import textwrap

import pytest

from helpers import TORCHRUN, TINY

pytestmark = pytest.mark.slow  # whole runs under torchrun: `pytest -m "not slow"` skips them

WRAPPER = textwrap.dedent('''
    import atexit, json, os, sys, time
    import dflash_dist.models.qwen3 as q
    import dflash_dist.roles.drafter as d
    slow_target, slow_drafter, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    seen = {"capture": [], "step": []}

    def timed(name, fn, pause):
        def run(*a, **k):
            t0 = time.perf_counter()
            time.sleep(pause)
            r = fn(*a, **k)
            seen[name].append(time.perf_counter() - t0)
            return r
        return run
    q.TinyQwen3.capture = timed("capture", q.TinyQwen3.capture, slow_target)
    d.drafter_step = timed("step", d.drafter_step, slow_drafter)
    atexit.register(lambda: open(f"{out}.{os.environ['RANK']}", "w").write(json.dumps(seen)))
    from dflash_dist.train import main
    sys.exit(main(sys.argv[4:]))
''')


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
    target = json.loads((tmp_path / "seen.1").read_text())["capture"][1:]  # [0]: the warm-up
    drafter = json.loads((tmp_path / "seen.0").read_text())["step"][1:]
    return summary, sum(target) / len(target), sum(drafter) / len(drafter)


@pytest.mark.parametrize("slow_target, slow_drafter", [(0.25, 0.05), (0.03, 0.25)])
def test_the_slow_side_makes_the_other_wait_and_only_it(tmp_path, slow_target, slow_drafter):
    summary, t_batch, d_step = run(tmp_path, slow_target, slow_drafter)
    # The fast side's period is the slow side's; it computes for its own stage's time of it.
    waiting, idle = ("drafters", "targets") if slow_target > slow_drafter else ("targets", "drafters")
    fast, slow = sorted((t_batch, d_step))
    truth = 1 - fast / slow
    print(f"slow {idle[:-1]}: {waiting} wait {summary['wait_' + waiting]:.3f} (truth {truth:.3f}), {idle} "
          f"{summary['wait_' + idle]:.3f}")
    assert abs(summary["wait_" + waiting] - truth) < 0.05, (summary["wait_" + waiting], truth)
    assert summary["wait_" + idle] < 0.05, summary["wait_" + idle]
    assert summary["balance"]["bottleneck"] == idle
