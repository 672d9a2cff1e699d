"""The rank-0 monitor: a daemon thread that reads counters and reports progress; and its sinks.

It never calls a collective or a send/recv (a thread that did could interleave with the main thread's
collectives and deadlock them): the main thread writes `Progress`, the monitor only reads it. Epoch
progress is measured against the count broadcast with this epoch's plan, overall progress against the
exact total of all epochs' counts.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil
import torch

from dflash_dist.config import choices
from dflash_dist.io.files import json_safe

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # the ETA's rate: batches over the steps of about the last minute
STALL_S = 30.0  # no new step for this long (at least 10 intervals): one "waiting" line, not a repeated one


@dataclass
class Progress:
    """Written by the main thread of rank 0 only; read by the monitor."""
    num_epochs: int
    epoch_counts: list[int]  # batches of every epoch, as planned at start
    epoch: int = 0
    epoch_batches: int = 0  # the count broadcast with this epoch's plan
    epoch_done: int = 0
    total_done: int = 0
    step: int = 0
    tokens: int = 0
    samples: int = 0
    loss: float = float("nan")
    acc: list[float] = field(default_factory=list)  # per block slot k >= 1
    accept_len: float = float("nan")
    lr: float = 0.0
    grad_norm: float = float("nan")  # of the last step, before clipping
    skipped_steps: int = 0  # steps not applied: non-finite loss or gradient norm
    drafter_wait_s: float = 0.0  # summed over drafters
    drafter_compute_s: float = 0.0
    target_wait_s: float = 0.0  # summed over targets (from packet headers)
    target_compute_s: float = 0.0
    started: float = field(default_factory=time.time)
    resumed_done: int = 0  # batches / tokens done before this process started (resume)
    resumed_tokens: int = 0
    resumed_samples: int = 0
    # (time, batches done, tokens) at the end of each recent step of this process: the rates' window. The
    # first entry is the first step's end, so neither start-up nor the first step's warm-up is in a rate.
    marks: deque = field(default_factory=lambda: deque(maxlen=512))
    tau: dict | None = None  # the last tau measured during training ({"step", "tau", ...})
    activity: str = ""  # what rank 0 is doing between steps, if anything (a "waiting" line says it)

    @property
    def total_batches(self) -> int:
        return sum(self.epoch_counts)

    def mark(self, now: float | None = None) -> None:
        """Main thread, after each step: one entry of the rates' window (a deque append is atomic)."""
        self.marks.append((time.time() if now is None else now, self.total_done, self.tokens))


def recent_rate(marks, window_s: float = RATE_WINDOW_S) -> tuple[float, float] | None:
    """(batches/s, tokens/s) between the oldest step end within `window_s` of the newest and the newest
    (at least the two newest); None before two steps have ended: no rate, no ETA."""
    marks = list(marks)
    if len(marks) < 2:
        return None
    t1, b1, k1 = marks[-1]
    inside = [m for m in marks[:-1] if m[0] >= t1 - window_s]
    t0, b0, k0 = inside[0] if inside else marks[-2]
    if t1 <= t0:
        return None
    return (b1 - b0) / (t1 - t0), (k1 - k0) / (t1 - t0)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def snapshot(p: Progress, device: torch.device) -> dict:
    elapsed = time.time() - p.started
    total = p.total_batches
    rate = recent_rate(p.marks)
    rec = {
        "time": round(elapsed, 3), "epoch": p.epoch + 1, "epochs": p.num_epochs,
        "batch": p.epoch_done, "batches_per_epoch": p.epoch_batches,
        "epoch_progress": p.epoch_done / p.epoch_batches if p.epoch_batches else 0.0,
        "total_progress": p.total_done / total if total else 0.0, "step": p.step,
        "tokens": p.tokens, "samples": p.samples,
        "tok_per_s": (p.tokens - p.resumed_tokens) / elapsed if elapsed > 0 else 0.0,  # this process's mean
        "samples_per_s": (p.samples - p.resumed_samples) / elapsed if elapsed > 0 else 0.0,
        # Recent rates (RATE_WINDOW_S): what the run does now, not its start-up; none before two step ends.
        "tok_per_s_recent": rate[1] if rate else float("nan"),
        "eta_s": (total - p.total_done) / rate[0] if rate and rate[0] > 0 else float("inf"),
        "loss": p.loss, "acc": list(p.acc), "accept_len": p.accept_len, "lr": p.lr,
        "wait_targets": wait_fraction(p.target_wait_s, p.target_compute_s),
        "wait_drafters": wait_fraction(p.drafter_wait_s, p.drafter_compute_s),
        "grad_norm": p.grad_norm, "skipped_steps": p.skipped_steps,
        "rss_gib": psutil.Process().memory_info().rss / 2**30,
        # Cumulative seconds: a report takes their differences for the wait fractions of each interval.
        "drafter_wait_s": p.drafter_wait_s, "drafter_compute_s": p.drafter_compute_s,
        "target_wait_s": p.target_wait_s, "target_compute_s": p.target_compute_s,
    }
    if p.tau is not None:
        rec["tau"], rec["tau_step"] = p.tau["tau"], p.tau["step"]
    if device.type == "cuda":
        rec["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return rec


def format_line(r: dict) -> str:
    acc1 = r["acc"][0] if r["acc"] else float("nan")
    tok_s = r.get("tok_per_s_recent", float("nan"))
    tok_s = r["tok_per_s"] if not math.isfinite(tok_s) else tok_s
    # Two figures, named apart: accept_len is the teacher-forced estimate on the training batches (an
    # upper bound of what decoding reaches: 4.21 against a measured 1.66 at the end of the default job);
    # tau is the last held-out measurement by real decoding (evaluation during training), "-" before one.
    tau = f"{r['tau']:.2f} @step {r['tau_step']}" if "tau" in r else "-"
    line = (f"epoch {r['epoch']}/{r['epochs']}  batch {r['batch']}/{r['batches_per_epoch']} "
            f"({100 * r['epoch_progress']:.0f}%)  total {100 * r['total_progress']:.0f}%  "
            f"{tok_s / 1e3:.1f}k tok/s  ETA {_fmt_eta(r['eta_s'])}  loss {r['loss']:.3f}  "
            f"gnorm {r.get('grad_norm', float('nan')):.2f}  "
            f"acc@1 {acc1:.2f}  accept_len(train) {r['accept_len']:.2f}  tau(held-out) {tau}  "
            f"wait: targets {100 * r['wait_targets']:.0f}% drafters {100 * r['wait_drafters']:.0f}%  "
            f"rss {r['rss_gib']:.1f} GiB")
    if r.get("skipped_steps"):
        line += f"  skipped {r['skipped_steps']} non-finite steps"
    if "gpu_mem_gib" in r:
        line += f"  gpu {r['gpu_mem_gib']:.1f} GiB"
    return line


def device_clock(device: torch.device):
    """A clock for wait/compute accounting. On CUDA kernels and NCCL waits are asynchronous: the CPU
    returns before the work is done, so each reading first waits for the current stream; one reading
    per stage boundary (a handful per step) is what true accounting costs."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()
    return now


def wait_fraction(wait_s: float, compute_s: float) -> float:
    """Share of a role's time spent waiting: the one definition used by monitor, summary and advice."""
    return wait_s / (wait_s + compute_s) if wait_s + compute_s > 0 else 0.0


class Sinks:
    """Console, JSONL in the run directory, and wandb (rank 0 only).

    A sink that fails (ENOSPC on metrics.jsonl, a wandb error) logs one warning and is switched off:
    training never stops for a metric. wandb never holds up the start: an online start-up that does not
    complete within `wandb.init_timeout_s` falls back to offline logging, to be uploaded later with
    `wandb sync`. `run_id` (kept with the training state as `.run_id`) continues the same wandb run on
    resume; a record whose step would not advance wandb's history is not logged as a row, so a resumed
    run never overwrites the rows logged before the checkpoint it restarted from.
    """

    def __init__(self, run_dir: Path, wandb_cfg, config_dict: dict, run_id: str | None = None):
        self.lock = threading.Lock()
        self.jsonl = None
        self.cut_lines = 0  # a last line an earlier process left without its end (1 or 0)
        try:
            path = Path(run_dir) / "metrics.jsonl"
            self.cut_lines = end_partial_line(path)
            self.jsonl = open(path, "a", buffering=1)
        except OSError as exc:
            self._drop_jsonl(exc)
        self.run_id = run_id
        self.wandb = None
        self._wandb_step = -1  # step of the last history row wandb holds
        mode = wandb_mode(wandb_cfg.mode)
        if mode != "disabled":
            self.wandb = _start_wandb(Path(run_dir), wandb_cfg, config_dict, mode, run_id)
        if self.wandb is not None:
            self.run_id = self.wandb.id
            self._wandb_step = self.wandb.step - 1  # a resumed run continues after its last row

    def write(self, rec: dict, console: bool = True, remote: bool = True) -> None:
        """`remote=False`: JSONL only (the per-step records, too many and too small for wandb's rows)."""
        with self.lock:
            if console:
                log.info(format_line(rec) if "batch" in rec else json.dumps(json_safe(rec)))
            if self.jsonl is not None:
                try:
                    self.jsonl.write(json.dumps(json_safe(rec), allow_nan=False) + "\n")
                except (OSError, ValueError) as exc:
                    self._drop_jsonl(exc)
            if self.wandb is not None and remote:
                try:
                    self._log_wandb(rec)
                except Exception as exc:  # wandb's service died, its disk is full, ...: metrics are not worth a run
                    log.warning("wandb logging failed (%s: %s): wandb is off for the rest of the run; JSONL goes "
                                "on", type(exc).__name__, exc)
                    self.wandb = None

    def _log_wandb(self, rec: dict) -> None:
        flat = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        flat.update({f"acc/{k + 1}": a for k, a in enumerate(rec.get("acc", [])) if math.isfinite(a)})
        step = rec.get("step")
        if isinstance(step, int) and step > self._wandb_step:
            self.wandb.log(flat, step=step)
            self._wandb_step = step
        elif rec.get("kind", "progress") != "progress":
            # The row of this step exists (an epoch end right after a progress tick, a stop, the
            # summary): keep it; the record goes to the run summary under its kind.
            self.wandb.summary.update({f"{rec['kind']}/{k}": v for k, v in flat.items()})

    def _drop_jsonl(self, exc: BaseException) -> None:
        log.warning("metrics.jsonl: write failed (%s): JSONL metrics are off for the rest of the run, training "
                    "goes on", exc)
        f, self.jsonl = self.jsonl, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # the buffered line it could not write fails again here

    def close(self) -> None:
        with self.lock:
            if self.jsonl is not None:
                try:
                    self.jsonl.close()
                except OSError as exc:
                    log.warning("metrics.jsonl: the last records could not be written (%s)", exc)
                self.jsonl = None
            if self.wandb is not None:
                try:
                    self.wandb.finish()
                except Exception as exc:
                    log.warning("wandb finish failed (%s: %s)", type(exc).__name__, exc)
                self.wandb = None


def end_partial_line(path: Path) -> int:
    """End a last line cut by an earlier process (a full disk, a kill mid-write) before appending, so the
    next record starts a line of its own instead of gluing itself to the fragment, which stays as one bad
    line (`report` names it). Returns the number of lines ended (0 or 1)."""
    if not path.is_file():  # none yet, or a device (/dev/full, whose reads never end): nothing to end
        return 0
    lines, cut = 0, 0  # line ends, and bytes after the last one (read in chunks: the file can be large)
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                n = chunk.count(b"\n")
                lines, cut = lines + n, len(chunk) - chunk.rfind(b"\n") - 1 if n else cut + len(chunk)
    except FileNotFoundError:
        return 0
    if not cut:
        return 0
    with open(path, "ab") as f:
        f.write(b"\n")
    log.warning("%s: line %d was cut short (%d bytes without a line end, left by an interrupted write: a full "
                "disk or a kill); ended it so new records start on a line of their own; it stays, one bad line",
                path, lines + 1, cut)
    return 1


SUPERSEDED = "metrics.superseded.jsonl"  # beside metrics.jsonl: records a resume redoes


def set_aside_records(path: Path, superseded: Callable[[dict], bool]) -> list[dict]:
    """Move the records of metrics.jsonl that `superseded` picks (those a resumed run will write again)
    to metrics.superseded.jsonl beside it, so that metrics.jsonl holds one record per step and measurement
    across resumes and nothing measured is thrown away. metrics.jsonl is rewritten atomically; a line that
    is not a JSON object stays where it is. Returns the records moved."""
    from dflash_dist.io.files import atomic_write
    if not path.is_file():
        return []
    kept, moved = [], []
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        (moved if isinstance(rec, dict) and superseded(rec) else kept).append((line, rec))
    if moved:
        with open(path.with_name(SUPERSEDED), "a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line, _ in moved)
        atomic_write(path, "".join(line for line, _ in kept))
    return [rec for _, rec in moved]


WANDB_MODES = choices()["wandb.mode"]
_WANDB_ALIASES = {"dryrun": "offline", "run": "online"}  # older spellings wandb still accepts


def wandb_mode(configured: str) -> str:
    """WANDB_MODE in the environment overrides `wandb.mode` from the config (a cluster may forbid
    online logging for every job); an unknown value is ignored with a warning."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return configured
    mode = _WANDB_ALIASES.get(env, env)
    if mode not in WANDB_MODES:
        log.warning("WANDB_MODE=%s is not one of %s: using wandb.mode=%s", env, WANDB_MODES, configured)
        return configured
    if mode != configured:
        log.info("WANDB_MODE=%s overrides wandb.mode=%s", env, configured)
    return mode


def _check_reachable(wandb, timeout_s: float) -> None:
    """Raise ConnectionError when wandb's server (its base_url: WANDB_BASE_URL, `wandb login --host`, or the
    default) takes no TCP connection within `timeout_s`. wandb.init retries a refused connection for about
    12 s whatever its init_timeout says; one connect bounded by the timeout finds the refusal at once."""
    url = urllib.parse.urlsplit(wandb.setup().settings.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"{url.hostname}:{port} is unreachable ({exc})") from exc


def _start_wandb(run_dir: Path, wandb_cfg, config_dict: dict, mode: str, run_id: str | None):
    """wandb.init with a bounded wait; online falls back to offline; any other failure turns wandb off."""
    import wandb

    def init(m: str):
        return wandb.init(project=wandb_cfg.project, name=wandb_cfg.name or None, mode=m, dir=str(run_dir),
                          config=config_dict, id=run_id, resume="allow" if run_id else None,
                          settings=wandb.Settings(init_timeout=wandb_cfg.init_timeout_s))

    t0 = time.monotonic()
    try:
        if mode == "online":
            _check_reachable(wandb, wandb_cfg.init_timeout_s)
        run = init(mode)
    except Exception as exc:  # wandb raises its own Error types, and whatever its service hits
        failed, waited = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}", time.monotonic() - t0
        if mode != "online":
            log.warning("wandb could not start in %s mode (%s): wandb is off; metrics.jsonl has every record",
                        mode, failed)
            return None
        try:
            run = init("offline")
        except Exception as exc2:
            log.warning("wandb could not start online (%s) nor offline (%s: %s): wandb is off; metrics.jsonl has "
                        "every record", failed, type(exc2).__name__, exc2)
            return None
        log.warning("wandb could not start online within %.1f s (%s): logging offline to %s instead; upload it "
                    "later with: wandb sync %s", waited, failed, run.settings.sync_dir,
                    run.settings.sync_dir)
        return run
    if mode == "offline":
        log.info("wandb is logging offline to %s (upload with: wandb sync %s)", run.settings.sync_dir,
                 run.settings.sync_dir)
    return run


class Monitor:
    """A line (and JSONL record) every `interval_s` in which a step ended; none while no step does,
    except one "waiting" line every `stall_s` (default: STALL_S, at least 10 intervals)."""

    def __init__(self, progress: Progress, sinks: Sinks, interval_s: float, device: torch.device,
                 stall_s: float | None = None):
        self.progress, self.sinks, self.interval_s, self.device = progress, sinks, interval_s, device
        self.stall_s = max(STALL_S, 10 * interval_s) if stall_s is None else stall_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def _run(self) -> None:
        reported, since = self.progress.step, time.time()  # the last line's step (a resume: its start), and when
        while not self._stop.wait(self.interval_s):
            p = self.progress
            if p.step > reported:
                self.report()
                reported, since = p.step, time.time()
            elif p.step > 0 and time.time() - since >= self.stall_s:
                log.info("waiting: no optimizer step for %.0f s (%slast: step %d, epoch %d batch %d/%d)",
                         time.time() - p.marks[-1][0] if p.marks else time.time() - since,
                         f"{p.activity}; " if p.activity else "", p.step, p.epoch + 1, p.epoch_done, p.epoch_batches)
                since = time.time()

    def report(self, kind: str = "progress", extra: dict | None = None) -> dict:
        rec = snapshot(self.progress, self.device)
        rec["kind"] = kind
        rec.update(extra or {})
        self.sinks.write(rec)
        return rec

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
