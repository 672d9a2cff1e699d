"""Checksummed, atomic training-state checkpoints, and the choice of where to resume.

Layout: RUN_DIR/checkpoints/step-00000123/{drafter.pt, meta.json}. drafter.pt holds the drafter's
weights, optimizer, scheduler, RNG and counters (only drafters have state: targets are frozen); meta.json
holds the cursor, the layout, the resolved config and the sha256 and size of every other file, small
enough for every rank (targets included) to read before the run starts.

Nothing half-written is ever picked: a save writes `step-N.tmp/` and renames it into place; a pruned
checkpoint is first renamed to `step-N.trash/` and only then deleted; `cleanup_leftovers` removes both
kinds (and directories left partial by older versions) on the next start. A checkpoint whose files do
not match their checksums (a torn copy, a bad disk) is skipped by `resume=auto` for the newest one
that does, and refused when named explicitly. meta.json carries its own checksum too (`meta_sha256`,
over its canonical JSON): an edited or damaged cursor is found like a damaged drafter.pt.

Only weights that were followed by a finite step are written (`train_state.TrainState.write`), and
pruning (`keep_last`) never removes the newest checkpoint known to be good: one whose weights a later
finite step used. What `train.resume` picks across roll-backs, fresh starts and divergences is the
run directory's lineage (lineage.py); what a resume trusts beyond the config (the cursor, the data,
the plan) is checked by `check_resume_data`.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash_dist.checkpoints import lineage
from dflash_dist.config import Config, ConfigError, to_dict, upgrade_dict
from dflash_dist.io.files import TMP_TAG, AtomicDir, file_sha256, json_safe
from dflash_dist.io.write_errors import write_error
from dflash_dist.plan.schedule import Cursor

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
STATE_FILE = "drafter.pt"
META_FILE = "meta.json"
TMP, TRASH = ".tmp", ".trash"  # suffixes of a save in progress and of a prune in progress
_NAME = re.compile(r"step-\d+")

# Config sections/keys that change what is trained: a checkpoint that disagrees on any is refused...
TRAINING_KEYS = ("model", "variant", "objective", "plan", "data", "optim", "train.seed", "train.epochs")
# ... except these, which change only the plan of the epochs still to come: allowed at an epoch boundary.
PLAN_KEYS = ("train.seed", "plan", "data", "objective.num_anchors")
# How the same computation is loaded, split or scheduled, not what it computes.
NOT_TRAINING = ("model.target.dtype", "model.target.path", "model.target.tensor_parallel",
                "model.draft.checkpoint_layers", "objective.anchor_chunk", "objective.loss_rows", "data.cache_dir")
# What may change at any resume, said in a warning: the knobs that get a diverged run going again.
RESUME_FREE = ("optim.lr", "optim.grad_clip")
LAYOUT_KEYS = ("num_drafters", "num_targets", "num_nodes", "ranks_per_node", "tensor_parallel")
_LOW_SPACE = 64 << 20  # bytes free below which a failed write is reported as a full disk


class CheckpointWriteError(OSError):
    """A save failed (full disk, I/O error); the message says which and where. Nothing partial is left."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step-{step:08d}"


def layout_meta(layout, tensor_parallel: int = 1) -> dict:
    """What meta.json records of the topology (a `topology.Layout`): shown when a resume changes it."""
    return {"num_drafters": layout.num_drafters, "num_targets": layout.num_targets, "num_nodes": layout.num_nodes,
            "ranks_per_node": layout.local_world_size, "tensor_parallel": int(tensor_parallel)}


# ------------------------------------------------------------------------------------------ writing

def save_checkpoint(run_dir: Path, step: int, state: dict, meta: dict, keep_last: int = 0,
                    good_before: int | None = None) -> Path:
    """Write `state` and `meta` (plus the files' checksums) atomically as checkpoint `step`; then prune
    all but the newest `keep_last` (0 = keep all) and, with `good_before` (the last finite step), the
    newest checkpoint of an earlier step, which that finite step vouches for. Raises
    CheckpointWriteError on a failed write, with the previous checkpoints intact."""
    final = checkpoint_path(run_dir, step)
    out = None
    try:
        # replace: the same step saved again (e.g. a stop right after a periodic save)
        out = AtomicDir(final, replace=True, tmp=final.with_name(final.name + TMP))
        torch.save(state, out.tmp / STATE_FILE)
        _fsync_file(out.tmp / STATE_FILE)
        files = {STATE_FILE: _file_record(out.tmp / STATE_FILE)}
        with open(out.tmp / META_FILE, "w") as f:  # written last: its checksums cover what is already on disk
            f.write(json.dumps(sealed(dict(meta, files=files)), indent=1, allow_nan=False) + "\n")
        out.commit()
    except (OSError, RuntimeError) as exc:  # torch reports a short write as a RuntimeError
        message = _write_failure(final, exc)
        if out is not None:
            out.abort()
        raise CheckpointWriteError(message) from exc
    log.info("saved checkpoint %s", final)
    if keep_last > 0:
        found = list_checkpoints(run_dir)
        good = newest_good(found, good_before)
        for victim in found[:-keep_last]:
            if victim != good:
                _remove(victim)
    return final


def step_of(path: Path) -> int:
    return int(Path(path).name.split("-", 1)[1])


def newest_good(found: list[Path], good_before: int | None) -> Path | None:
    """The newest of `found` known to be good: its weights were used by a finite step (one numbered
    below `good_before`, the last finite step; skipped steps leave the weights as they were)."""
    good = [p for p in found if good_before is not None and step_of(p) < good_before]
    return good[-1] if good else None


def _canonical(meta: dict) -> bytes:
    return json.dumps(json_safe({k: v for k, v in meta.items() if k != "meta_sha256"}), sort_keys=True,
                      separators=(",", ":"), allow_nan=False).encode()


def sealed(meta: dict) -> dict:
    """`meta` (JSON-safe) with `meta_sha256`, the sha256 of its canonical JSON."""
    meta = json_safe(meta)
    return dict(meta, meta_sha256=hashlib.sha256(_canonical(meta)).hexdigest())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _file_record(path: Path) -> dict:
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size}


def _write_failure(final: Path, exc: BaseException) -> str:
    """The reason a save failed, in words: a full disk (ENOSPC / quota, or almost no space left, which
    is what torch's bare "unexpected pos" error means in practice) or another write error."""
    err = write_error(exc)  # the errno may sit on a cause (torch wraps the OSError of its writer)
    codes = {err.errno} if err is not None else set()
    try:
        free = shutil.disk_usage(next(p for p in (final.parent, *final.parents) if p.exists())).free
    except (OSError, StopIteration):
        free = -1
    where = f"{free / 2**20:.0f} MiB free there" if free >= 0 else "free space unknown"
    if codes & {errno.ENOSPC, errno.EDQUOT} or 0 <= free < _LOW_SPACE:
        reason = f"the disk is full ({where}; {type(exc).__name__}: {exc})"
    else:
        reason = f"the write failed ({type(exc).__name__}: {exc}; {where})"
    return (f"cannot save checkpoint {final}: {reason}. The previous checkpoints are intact and no partial "
            "one was left; free space or move train.run_dir, then resume")


def _remove(path: Path) -> None:
    """Delete a checkpoint so that a crash at any point leaves either the complete checkpoint or a
    `.trash` name that nothing resumes from and the next start removes."""
    trash = path.with_name(path.name + TRASH)
    try:
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash)
    except OSError as exc:  # a prune that fails costs disk space, not the run
        log.warning("could not delete old checkpoint %s: %s", path, exc)


def cleanup_leftovers(run_dir: Path) -> list[str]:
    """Remove what interrupted saves and prunes left behind (`.tmp` and `.trash` checkpoints, a
    `step-N/` without its files, temporary files of atomic writes in the run directory). Rank 0 calls
    it at start, holding the run lock, so no save of this run can be in progress. Returns the paths
    removed (the caller logs them)."""
    run_dir, removed = Path(run_dir), []
    root = run_dir / CKPT_DIR
    candidates = [p for p in root.iterdir()] if root.is_dir() else []
    for p in sorted(candidates):
        partial = _NAME.fullmatch(p.name) and p.is_dir() and not _is_complete(p)
        moved_aside = p.name.startswith(".") and ".old-" in p.name  # an AtomicDir replace killed mid-way
        if partial or moved_aside or p.name.endswith((TMP, TRASH)):
            _delete(p)
            removed.append(str(p))
    if run_dir.is_dir():
        for p in sorted(run_dir.iterdir()):
            if p.is_file() and p.name.startswith(".") and (TMP_TAG in p.name or p.name.startswith(".write-test-")):
                _delete(p)
                removed.append(str(p))
    return removed


def _delete(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ reading

def _is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / META_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (both files present), oldest first; `.tmp`, `.trash` and partial
    directories are ignored. Their checksums are verified by `find_resumable` / `checkpoint_problem`."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.fullmatch(p.name) and _is_complete(p))


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed (naming the file), or None when every file it lists
    has the size and sha256 its meta.json records."""
    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.is_file():
        return f"{meta_file} is missing"
    try:
        meta = json.loads(meta_file.read_text())
        files = meta["files"]
        records = [(name, int(rec["bytes"]), str(rec["sha256"])) for name, rec in files.items()]
        meta_cursor(meta), meta["config"]  # present and well-formed
    except (OSError, ValueError) as exc:
        return f"{meta_file} is unreadable: {exc}"
    except (KeyError, TypeError, AttributeError) as exc:
        return f"{meta_file} lacks {exc} (written by an older version, or damaged)"
    if "meta_sha256" in meta and hashlib.sha256(_canonical(meta)).hexdigest() != meta["meta_sha256"]:
        return f"{meta_file} does not match its own meta_sha256 (the file was edited or is damaged)"
    if STATE_FILE not in files:
        return f"{meta_file} lists no checksum for {STATE_FILE}"
    for name, size, digest in records:
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {META_FILE} recorded {size} (truncated or overwritten)"
        if file_sha256(f) != digest:
            return f"{f} does not match its sha256 in {META_FILE} (the file is damaged)"
    return None


def find_resumable(run_dir: Path) -> Path | None:
    """The newest checkpoint of `run_dir` whose files match their checksums; each newer one that does
    not is logged with the reason and skipped. None when there is no checkpoint at all; a ConfigError
    when there are some and none is valid (starting over would silently throw the run away)."""
    found = list_checkpoints(run_dir)
    problems = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            if problems:
                log.warning("resuming from %s, the newest valid checkpoint", path)
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
        problems.append(problem)
    if problems:
        raise ConfigError(f"none of the {len(found)} checkpoints in {Path(run_dir) / CKPT_DIR} can be resumed:\n  "
                          + "\n  ".join(problems) + "\nrestore or remove them, name one with train.resume=PATH, "
                          "or start over with train.resume=none")
    return None


def read_meta(path: Path) -> dict:
    f = Path(path) / META_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"checkpoint {path}: cannot read {META_FILE}: {exc}") from exc


def meta_cursor(meta: dict) -> Cursor:
    c = meta["cursor"]
    return Cursor(int(c["epoch"]), int(c["batch"]))


def completed(meta: dict, cfg: Config) -> bool:
    """The checkpoint was cut after the last epoch: only the end-of-run work (evaluation, export,
    summary) may be left to do."""
    return meta_cursor(meta).epoch >= cfg.train.epochs


def load_state(path: Path) -> dict:
    f = Path(path) / STATE_FILE
    if not f.is_file():
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is missing")
    return torch.load(f, map_location="cpu", weights_only=False)


# ------------------------------------------------------------------------------- resume decisions

def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == t or key.startswith(t + ".") for t in prefixes)


def _differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """A key the checkpoint's config lacks was added to the schema after it was written: it counts as the
    key's default (a new key's default keeps the old behaviour), so adding a key orphans no checkpoint; a
    config written before the `variant` section is read in today's form (`config.upgrade_dict`)."""
    a, b = {**_flatten(to_dict(Config())), **_flatten(upgrade_dict(saved))}, _flatten(current)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if _under(k, TRAINING_KEYS) and not _under(k, NOT_TRAINING) and a.get(k) != b.get(k)]


def config_differences(saved: dict, current: dict) -> list[str]:
    """Every training key that differs, as "key: checkpoint X, now Y"."""
    return [f"{k}: checkpoint {x!r}, now {y!r}" for k, x, y in _differences(saved, current)]


def _format_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    return "\n  ".join(f"{k}: checkpoint {x!r}, now {y!r}" for k, x, y in diffs)


def check_plan(meta: dict, path: Path, digests: list[str]) -> None:
    """A checkpoint cut mid-epoch continues that epoch's plan at its cursor: the plan rebuilt now must be
    the one it was cut from, or the rest of the epoch would repeat some samples and skip others. Same
    config, another numpy or torch (whose shuffle streams carry no cross-version guarantee) could differ."""
    c, saved = meta["cursor"], meta.get("plan_digests")
    epoch, batch = int(c["epoch"]), int(c["batch"])
    if not saved or batch == 0 or epoch >= len(saved):
        return  # at an epoch boundary nothing of the old plan is reused (or a checkpoint from before this check)
    if saved[epoch] != digests[epoch]:
        raise ConfigError(f"checkpoint {path} was cut at epoch {epoch + 1} batch {batch} of a plan with "
                          f"fingerprint {saved[epoch]}, but the same config and data now build {digests[epoch]} "
                          "(another numpy or torch version?); resuming mid-epoch would repeat or skip samples. Resume "
                          "with the original environment, from a checkpoint at an epoch boundary, or start "
                          "over with train.resume=none")


def check_resume_data(meta: dict, path: Path, cfg: Config, counts, digests: list[str], data: dict) -> None:
    """Rank 0, with the plans counted: what a resume trusts beyond the config. The cursor must lie within
    the plan, the dataset must be the one the checkpoint was trained on (`data`: `data.digest.dataset_digest`;
    a new one is allowed only where the data config changed too, at an epoch boundary), and a mid-epoch
    cursor needs the same plan (`check_plan`). A ConfigError names what differs."""
    c, epochs = meta_cursor(meta), len(counts)
    inside = 0 <= c.epoch < epochs and 0 <= c.batch < counts[c.epoch] or c.epoch == epochs and c.batch == 0
    if not inside:
        raise ConfigError(f"checkpoint {path}: its cursor (epoch {c.epoch + 1}, batch {c.batch}) lies outside the "
                          f"plan ({epochs} epochs of {list(counts)} batches); its {META_FILE} was edited or damaged. "
                          "Resume another checkpoint with train.resume=PATH, or start over with train.resume=none")
    saved = meta.get("data")
    changed = _data_change(saved, data) if saved else None  # older checkpoints carry no digest
    data_keys = [k for k, _, _ in _differences(meta["config"], to_dict(cfg)) if _under(k, ("data",))]
    if changed and (c.batch != 0 or not data_keys):
        raise ConfigError(f"checkpoint {path} was trained on other data: {changed}, under the same data config. "
                          "Resume with the data it was trained on; to go on with new data, give its data.path at an "
                          "epoch boundary; or start over with train.resume=none")
    if changed:
        log.warning("resuming %s at an epoch boundary on new data (%s): %s", path, ", ".join(data_keys), changed)
    check_plan(meta, path, digests)


def _data_change(saved: dict, now: dict) -> str | None:
    """In words, how the dataset `now` differs from the one a checkpoint recorded (None: the same)."""
    if saved.get("samples") != now["samples"]:
        return f"{now['samples']} samples now, {saved.get('samples')} then"
    what = [name for name in ("offsets", "tokens", "loss_mask") if saved.get(name) != now[name]]
    words = {"offsets": "the samples' lengths", "tokens": "the tokens", "loss_mask": "the loss mask"}
    return " and ".join(words[w] for w in what) + f" changed ({now['samples']} samples, as then)" if what else None


def check_resumable(meta: dict, cfg: Config, path: Path, *, report: bool = True) -> Cursor:
    """Refuse (ConfigError) a checkpoint trained with another setup; allow a changed plan at an epoch
    boundary, a changed learning rate or clip anywhere (RESUME_FREE: the way out of a divergence) and any
    change of layout, logging what changed. Returns the cursor."""
    cursor = meta_cursor(meta)
    diffs = _differences(meta["config"], to_dict(cfg))
    free = [d for d in diffs if _under(d[0], RESUME_FREE)]
    other = [d for d in diffs if not _under(d[0], PLAN_KEYS + RESUME_FREE)]
    plan = [d for d in diffs if _under(d[0], PLAN_KEYS)]
    if free and report:
        log.warning("resuming %s with another %s (allowed at any resume; the schedule keeps its place):\n  %s", path,
                    " and ".join(d[0] for d in free), _format_differences(free))
    if other:
        raise ConfigError(f"checkpoint {path} was trained with another setup; refusing to resume:\n  "
                          f"{_format_differences(other)}\nresume with the original values, or start over with "
                          "train.resume=none")
    if plan and cursor.batch != 0:
        raise ConfigError(f"checkpoint {path} was cut in the middle of epoch {cursor.epoch + 1} (batch "
                          f"{cursor.batch}); these settings change the plan, which may change only at an epoch "
                          f"boundary:\n  {_format_differences(plan)}\nresume with the original values, or start "
                          "over with train.resume=none")
    if plan and report:
        log.warning("resuming %s at the start of epoch %d with settings that change the plan (allowed at an "
                    "epoch boundary: epochs from %d on follow the new plan):\n  %s", path, cursor.epoch + 1,
                    cursor.epoch + 1, _format_differences(plan))
    return cursor


def layout_changes(saved: dict, current: dict) -> list[str]:
    return [f"{k} {saved.get(k)} -> {current.get(k)}" for k in LAYOUT_KEYS
            if k in saved and saved.get(k) != current.get(k)]


def resolve_resume(cfg: Config, layout, *, report: bool = True) -> tuple[Path | None, Cursor]:
    """Which checkpoint to continue from (train.resume = auto | none | PATH), validated against the
    current config and `layout` (a `topology.Layout`). Every rank calls this before training, on the
    same (shared) run directory; `report=False` keeps the warnings to one rank."""
    mode, run_dir = cfg.train.resume, Path(cfg.train.run_dir)
    if mode == "none":
        return None, Cursor(0, 0)
    if mode != "auto" and lineage.applied(run_dir, Path(mode)):
        if report:
            log.info("train.resume=%s started this run's lineage at an earlier start (%s): continuing the run from "
                     "its newest checkpoint, as train.resume=auto does (a requeue never rolls back twice)", mode,
                     run_dir / lineage.LINEAGE_FILE)
        mode = "auto"
    if mode == "auto":
        path = find_resumable(run_dir) or lineage.origin(run_dir)  # a roll-back with no checkpoint of its own yet
        if path is None:
            return None, Cursor(0, 0)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(f"this run continues from checkpoint {path} ({run_dir / lineage.LINEAGE_FILE}), which "
                              f"cannot be resumed: {problem}. Name another with train.resume=PATH, or start over "
                              "with train.resume=none")
    else:
        path = Path(mode)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError(f"config key 'train.resume': checkpoint {path} cannot be resumed: {problem}. Name "
                              "another checkpoint, use train.resume=auto for the newest valid one, or start "
                              "over with train.resume=none")
    meta = read_meta(path)
    cursor = check_resumable(meta, cfg, path, report=report)
    now = layout_meta(layout, getattr(cfg.model.target, "tensor_parallel", 1))
    changed = layout_changes(meta.get("layout", {}), now)
    if changed and report:
        log.warning("resuming %s on another layout (%s): the run continues exactly in data order (the same plan "
                    "from batch %d of epoch %d, the same anchors, the restored optimizer) but not bitwise, since "
                    "gradients are now reduced over another set of ranks", path, ", ".join(changed), cursor.batch,
                    cursor.epoch + 1)
    return path, cursor


# --------------------------------------------------------------------------------- the run's lineage

def begin_run(cfg: Config) -> Path | None:
    """Rank 0, once the start is checked: make train.resume's choice the run directory's lineage. A roll-
    back (a PATH named for the first time) sets aside the checkpoints newer than PATH (all of them when PATH
    lies outside the run directory); train.resume=none sets aside all; a continuing start changes nothing.
    Returns where the abandoned checkpoints went (None: none)."""
    mode, run_dir = cfg.train.resume, Path(cfg.train.run_dir)
    if mode == "auto" or mode != "none" and lineage.applied(run_dir, Path(mode)):
        return None
    src = Path(mode).resolve() if mode != "none" else None
    found = list_checkpoints(run_dir)
    keep = [p for p in found if src is not None and p.parent.resolve() == src.parent and step_of(p) <= step_of(src)]
    aside = lineage.set_aside(run_dir / CKPT_DIR, [p for p in found if p not in keep],
                              "rolled-back" if src is not None else "started-over")
    if aside is not None:
        log.warning("train.resume=%s: the checkpoints this run no longer continues were moved to %s (nothing "
                    "deleted; train.resume=auto never takes them)", mode, aside)
    lineage.record(run_dir, mode, src, read_meta(src).get("step", 0) if src else 0, aside)
    return aside


def after_divergence(run_dir: Path, last_finite_step: int) -> tuple[Path | None, Path | None]:
    """Rank 0, when the run stops for divergence: set aside the checkpoints whose weights led only to
    non-finite steps (those of step >= the last finite step), so that train.resume=auto takes the newest
    one known to be good. Returns (where they went, the newest good checkpoint or None)."""
    found = list_checkpoints(run_dir)
    good = newest_good(found, last_finite_step)
    bad = [p for p in found if step_of(p) >= last_finite_step]
    return lineage.set_aside(Path(run_dir) / CKPT_DIR, bad, "diverged"), good
