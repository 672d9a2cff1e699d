"""Benchmark sections that each run in a process of their own under a hard timeout, and their report.

A section's process writes its rows to a JSON file as it goes (`Report`), so a section ended at its
timeout still reports what it had measured; `run_tree` ends the section's whole process tree (torchrun's
workers start sessions of their own), and the next section starts. Used by bench.gpu_check.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import psutil

from dflash_dist.io.files import atomic_write

ROOT = Path(__file__).resolve().parents[2]


# -- the report ---------------------------------------------------------------------------------------

class Report:
    """A section's rows, rewritten to `path` after every row: a section killed at its timeout still
    reports what it had measured."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.rows: list[tuple[str, object, str]] = []
        self.extra: dict[str, str] = {}

    def add(self, metric: str, value, note: str = "") -> None:
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        self.rows.append((metric, value, note))
        self.save()

    def save(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps({"rows": self.rows, **self.extra}, default=str))


def fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def print_table(results: dict[str, dict]) -> None:
    rows = [(name, m, fmt(v), n) for name, r in results.items()
            for m, v, n in [("status", r["status"], r.get("error", ""))] + [tuple(x) for x in r["rows"]]]
    w = [max(len(r[i]) for r in rows + [("section", "metric", "value", "")]) for i in range(3)]
    print(f"\n{'section':<{w[0]}}  {'metric':<{w[1]}}  {'value':>{w[2]}}  note")
    for s, m, v, n in rows:
        print(f"{s:<{w[0]}}  {m:<{w[1]}}  {v:>{w[2]}}  {n}")


# -- running a process tree under a hard timeout ------------------------------------------------------

def end_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to proc's session group and to every descendant (torchrun starts its workers in sessions of
    their own, out of reach of the group), SIGKILL to whatever is left after `grace` seconds."""
    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for sig_all in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig_all)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree:
            try:
                p.send_signal(sig_all)
            except psutil.NoSuchProcess:
                pass
        if sig_all == signal.SIGTERM:
            _, alive = psutil.wait_procs(tree, timeout=grace)
            tree = alive
    proc.wait()


def run_tree(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """(exit code, or None when it timed out and was ended; stdout+stderr; seconds)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: a chatty child never blocks on it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                text=True, cwd=ROOT)
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            end_tree(proc)
            rc = None
        out.seek(0)
        return rc, out.read(), time.perf_counter() - t0


def run_sections(module: str, names: list[str], dry: bool, budget_s: float, caps: dict[str, float]) -> dict[str, dict]:
    """Each section in its own process (`python -m module --section NAME ...`), one after the other,
    never past the budget."""
    results: dict[str, dict] = {}
    tag = f"[{module.rsplit('.', 1)[-1]}]"
    deadline = time.monotonic() + budget_s
    scratch = Path(tempfile.mkdtemp(prefix="sections-"))
    for name in names:
        left = deadline - time.monotonic()
        if left < 5:
            results[name] = {"status": "skipped", "error": f"the {budget_s:g} s budget is spent", "rows": []}
            print(f"{tag} {name}: skipped (budget spent)", flush=True)
            continue
        timeout = min(caps[name], left)
        result = scratch / f"{name}.json"
        cmd = [sys.executable, "-m", module, "--section", name, "--result", str(result),
               "--timeout-s", f"{timeout:.1f}"] + (["--dry-run"] if dry else [])
        print(f"{tag} {name}: running (at most {timeout:.0f} s)", flush=True)
        rc, out, secs = run_tree(cmd, timeout)
        data = json.loads(result.read_text()) if result.exists() else {"rows": []}
        r = {"rows": data["rows"], "seconds": secs, "timeout_s": timeout}
        if rc == 0:
            r["status"] = "ok"
        else:
            r["status"] = "timed out" if rc is None else f"failed (exit {rc})"
            last = [line for line in out.splitlines() if line.strip()]
            r["error"] = data.get("error") or (f"ended after {timeout:.0f} s" if rc is None else (last or ["?"])[-1][:160])
            r["log_tail"] = out[-4000:]
            if "traceback" in data:
                r["traceback"] = data["traceback"]
        results[name] = r
        print(f"{tag} {name}: {r['status']} in {secs:.0f} s", flush=True)
    return results


def run_one(runner: Callable[[Report, bool, float], None], result: Path, dry: bool, timeout_s: float) -> int:
    """The body of a section's process: its rows go to `result` as they come."""
    import logging
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    rep = Report(result)
    try:
        runner(rep, dry, time.monotonic() + timeout_s)
    except Exception as exc:
        rep.extra.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}",
                         traceback=traceback.format_exc())
        rep.save()
        traceback.print_exc()
        return 1
    return 0
