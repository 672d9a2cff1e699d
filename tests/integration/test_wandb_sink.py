"""The wandb sink with wandb's own service process: offline resumes the same run id, and an unreachable
online server falls back to offline within the timeout."""
import logging
import time

from helpers import wandb_cfg


def test_wandb_offline_resumes_the_same_run_id(tmp_path, wandb_env):
    from dflash_dist.observe.monitor import Sinks
    first = Sinks(tmp_path, wandb_cfg("offline"), {"a": 1})
    run_id = first.run_id
    assert first.wandb is not None and first.wandb.settings.mode == "offline" and run_id
    first.write({"kind": "progress", "step": 3, "loss": 1.0}, console=False)
    first.close()
    again = Sinks(tmp_path, wandb_cfg("offline"), {"a": 1}, run_id=run_id)
    assert again.run_id == run_id == again.wandb.id
    again.close()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r for r in runs)  # one directory per start, one id


def test_unreachable_wandb_online_falls_back_to_offline_within_the_timeout(tmp_path, wandb_env, caplog):
    from dflash_dist.observe.monitor import Sinks
    wandb_env.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: connection refused, retried
    wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dflash_dist.observe.monitor"):
        sinks = Sinks(tmp_path, wandb_cfg("online", timeout=2.0), {})
    took = time.monotonic() - t0
    try:
        assert sinks.wandb is not None and sinks.wandb.settings.mode == "offline"
        assert took < 2.0 + 5, took  # the bounded wait, plus an offline start on a loaded 2-core machine (was 12-13 s more)
        sync = sinks.wandb.settings.sync_dir
        assert "wandb could not start online within" in caplog.text
        assert f"logging offline to {sync} instead; upload it later with: wandb sync {sync}" in caplog.text
        sinks.write({"kind": "progress", "step": 1, "loss": 1.0}, console=False)
    finally:
        sinks.close()
    print(f"unreachable wandb online -> offline after {took:.1f} s (init_timeout_s=2)")
