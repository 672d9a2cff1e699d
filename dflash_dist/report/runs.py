"""A run as the report sees it: the records of its `metrics.jsonl` by kind, and its `summary.json`.

Nothing else of a run directory is read, so a report can be made anywhere the two files are copied to,
during a run or after it. A resumed run appends to the same `metrics.jsonl`: every process starts with a
`plan` record, its times restart at 0 and its first steps may repeat steps that the one before it trained
after the checkpoint it resumed from (and the tau of the checkpoint's step). `RunData` lays the processes
end to end on one time axis and keeps, of a step (or a step's tau) recorded twice, the later record (the
one whose weights went on).
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class ReportInputError(ValueError):
    """A run directory or one of its files cannot be read; the message names the file (and line)."""


@dataclass
class RunData:
    label: str
    path: Path
    records: list[dict]  # every record of metrics.jsonl in file order, with `_t`: time on the joined axis
    summary: dict | None  # summary.json, None while the run has not finished
    notes: list[str] = field(default_factory=list)  # what the reader should know about this run's files

    def kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind", "progress") == kind]

    def steps(self) -> list[dict]:
        """One `step` record per optimizer step, in step order; of a step recorded twice, the later."""
        by_step = {r["step"]: r for r in self.kind("step")}
        return [by_step[s] for s in sorted(by_step)]

    def taus(self) -> list[dict]:
        """One `tau` record per step it was measured at, in step order; of a step measured twice, the later
        (a run killed after a checkpoint and its step's tau measures it again on resume: summary.json's
        tau_during_training holds that one)."""
        by_step = {r["step"]: r for r in self.kind("tau")}
        return [by_step[s] for s in sorted(by_step)]

    def plan(self) -> dict:
        """The last process's `plan` record (counts, packing, budgets), or {} for a run before it existed."""
        plans = self.kind("plan")
        return plans[-1] if plans else {}

    def epoch_plans(self) -> dict[int, dict]:
        """epoch -> its `epoch_plan` record (batches as broadcast, as counted at start, batch shape)."""
        return {r["epoch"]: r for r in self.kind("epoch_plan")}

    def epoch_ends(self) -> dict[int, dict]:
        return {r["epoch"]: r for r in self.kind("epoch_end")}

    def state(self) -> str:
        """How the run ended, as far as its files tell."""
        if self.summary is not None:
            return "finished"
        ends = [r for r in self.records if r.get("kind") in ("stopped", "diverged", "summary")]
        last = self.records[-1] if self.records else {}
        if ends and ends[-1] is last:
            return {"stopped": "stopped on request (resumable)", "diverged": "diverged (non-finite loss)"}.get(
                last["kind"], last["kind"])
        return f"running, or ended without a summary (last record: step {last.get('step', 0)})"


def load_run(path: Path, label: str | None = None) -> RunData:
    """Read one run directory. Raises ReportInputError naming the file (and line) that cannot be read."""
    path = Path(path)
    if not path.is_dir():
        raise ReportInputError(f"{path}: not a directory (give a run's train.run_dir)")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportInputError(f"{metrics}: not found (a run writes it on rank 0 from its first step)")
    notes: list[str] = []
    records = _read_jsonl(metrics, notes)
    summary = None
    summary_path = path / "summary.json"
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportInputError(f"{summary_path}: cannot be read as JSON: {exc}") from exc
        if not isinstance(summary, dict):
            raise ReportInputError(f"{summary_path}: expected a JSON object, found {type(summary).__name__}")
    _join_times(records)
    return RunData(label or path.resolve().name, path, records, summary, notes)


def _read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReportInputError(f"{path}: cannot be read: {exc}") from exc
    lines = data.split(b"\n")  # bytes, not text: a line that is not UTF-8 is named, not a traceback
    records = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ReportInputError(f"{path}:{n}: not UTF-8 text (byte {exc.start + 1} of the line)") from exc
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # no newline after it: the run is writing it now, or was killed mid-line
                notes.append(f"{path.name}: line {n} is incomplete (a run still writing, or killed) and was not read")
                log.warning("%s:%d: incomplete last line not read", path, n)
                continue
            if _cut_short(line):  # a writer stopped mid-record (a full disk, a kill); the next one ended the line
                notes.append(f"{path.name}: line {n} is a record cut short (a full disk, or a kill mid-write) and "
                             f"was not read")
                log.warning("%s:%d: a record cut short was not read", path, n)
                continue
            rec = _after_a_cut(line)
            if rec is None:
                raise ReportInputError(f"{path}:{n}: not a JSON record: {exc}") from exc
            notes.append(f"{path.name}: line {n} starts with a record cut short (a full disk, or a kill mid-write), "
                         f"which was not read; the record after it on the same line was")
            log.warning("%s:%d: a record cut short was not read; the one glued to it was", path, n)
        if not isinstance(rec, dict):
            raise ReportInputError(f"{path}:{n}: expected a JSON object, found {type(rec).__name__}")
        _check_record(rec, path, n)
        records.append(rec)
    return records


def _cut_short(text: str) -> bool:
    """Whether `text` is the start of a JSON object that ends too soon: the decoder ran out of input (an
    open string, or an error at the very end), not into a wrong character."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        rest = text[exc.pos:].rstrip()
        return text.startswith("{") and (not rest or exc.msg.startswith("Unterminated string")
                                         or any(w.startswith(rest) for w in ("true", "false", "null"))
                                         or _NUMBER_START.fullmatch(rest) is not None)
    return False


_NUMBER_START = re.compile(r"-?\d*(\.\d*)?([eE][+-]?\d*)?")  # what a number cut short can look like


def _after_a_cut(line: str) -> dict | None:
    """The whole record at the end of `line` when the line is a record cut short with the next process's
    first record written straight after it (the writer died mid-line; the next one appended); else None."""
    for i in range(len(line) - 1, 0, -1):
        if line.startswith('{"', i) and _cut_short(line[:i]):
            try:
                rec = json.loads(line[i:])
            except json.JSONDecodeError:
                continue
            return rec if isinstance(rec, dict) else None
    return None


# What the report sorts, groups and indexes by: kind -> keys it must have, as integers. Every other value
# is read as a number where it is one and as missing where not (plotting.values).
REQUIRED_INTS = {"step": ("step", "epoch"), "tau": ("step",), "epoch_plan": ("epoch",), "epoch_end": ("epoch",)}
INT_KEYS = ("step", "epoch")


def _check_record(rec: dict, path: Path, n: int) -> None:
    kind = rec.get("kind", "progress")
    if not isinstance(kind, str):
        raise ReportInputError(f"{path}:{n}: 'kind' is {json.dumps(kind)}, not a string")
    required = REQUIRED_INTS.get(kind, ())
    for key in required:
        if key not in rec:
            raise ReportInputError(f"{path}:{n}: a {kind!r} record without {key!r}")
    for key in INT_KEYS:
        v = rec.get(key)
        if key not in rec or (v is None and key not in required):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ReportInputError(f"{path}:{n}: {key!r} is {json.dumps(v)}, not a whole number >= 0")


def _join_times(records: list[dict]) -> None:
    """`_t`: each record's time on one axis over the run's processes (each starts its clock at 0); a
    process is known by its `plan` record, or by a clock that went back."""
    offset = last = 0.0
    for r in records:
        t = r.get("time")
        if r.get("kind") == "plan":
            offset = last
        if isinstance(t, (int, float)) and math.isfinite(t):
            if t + offset < last - 1.0:  # a process without a plan record (older runs) restarted its clock
                offset = last
            r["_t"] = t + offset
            last = r["_t"]
