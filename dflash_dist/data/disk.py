"""The prepared on-disk dataset: a directory of flat memory-mapped arrays plus meta.json.

    tokens.bin     uint32, every sample's tokens concatenated
    offsets.bin    int64, num_samples + 1 entries: sample i is tokens[offsets[i]:offsets[i+1]]
    loss_mask.bin  uint8, one 0/1 per token (1 = supervised)
    meta.json      format_version, num_samples, num_tokens, vocab_size, plus how it was made
                   (tokenizer, max_length, made_by, skipped counts by reason, ...)

Writes are atomic: everything goes into a hidden temporary sibling directory, each file is fsynced,
meta.json is written last, and only then is the directory renamed into place. A crash leaves either
no `out_dir` at all or the previous one, never a half-written directory under the final name; a
leftover temporary directory is refused by `open_dataset` (by its name, and it lacks meta.json until
the arrays are complete).

Opening is read-only through np.memmap, so the ranks of a node share the page cache, and validates
every structural invariant (vectorised, in chunks, so 1B tokens take seconds, not minutes): a bad
file fails the run at start with a DatasetError naming the file, not a crash hours later.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

from dflash_dist.data.dataset import TokenDataset
from dflash_dist.io.files import TMP_TAG, AtomicDir, fsync_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META = "meta.json"
TOKENS, OFFSETS, LOSS_MASK = "tokens.bin", "offsets.bin", "loss_mask.bin"
DTYPES = {TOKENS: np.dtype(np.uint32), OFFSETS: np.dtype(np.int64), LOSS_MASK: np.dtype(np.uint8)}
REQUIRED_META = ("format_version", "num_samples", "num_tokens", "vocab_size")
CHUNK = 1 << 24  # tokens per validation step: bounded temporaries (~200 MB) whatever the dataset size


class DatasetError(ValueError):
    """The on-disk dataset is missing, torn or inconsistent; the message names the file (and sample)."""


@dataclass(frozen=True)
class DiskDataset(TokenDataset):
    """A TokenDataset over memory-mapped files, with the meta.json it was opened from."""
    meta: dict | None = None
    path: str = ""


# ----------------------------------------------------------------------------------------- writing

class DatasetWriter:
    """Streams samples into a temporary sibling of `out_dir`; `commit` makes it appear atomically.

    Use as a context manager: leaving the block by an exception removes the temporary directory.
    """

    def __init__(self, out_dir: str | os.PathLike, *, vocab_size: int, overwrite: bool = False):
        self.out_dir = Path(out_dir).absolute()
        if self.out_dir.exists() and not overwrite:
            raise FileExistsError(f"{self.out_dir} already exists (pass overwrite=True / --overwrite to replace it)")
        if vocab_size <= 0 or vocab_size > np.iinfo(np.uint32).max:
            raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
        self.vocab_size = int(vocab_size)
        self.overwrite = overwrite
        self._dir = AtomicDir(self.out_dir, replace=overwrite)  # temporary directories never open (TMP_TAG)
        self.tmp = self._dir.tmp
        self._files: dict[str, BinaryIO] = {}
        try:  # no `with` guards the constructor: a failure here (EMFILE, SIGTERM) aborts the temporary itself
            for name in (TOKENS, LOSS_MASK, OFFSETS):
                self._files[name] = open(self.tmp / name, "wb")
            self._files[OFFSETS].write(np.zeros(1, dtype=np.int64).tobytes())
        except BaseException:
            self.abort()
            raise
        self.num_samples = 0
        self.num_tokens = 0
        self.num_supervised = 0

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, tokens: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append one sample."""
        tokens, loss_mask = np.asarray(tokens), np.asarray(loss_mask)
        self.add_many(tokens, np.array([0, len(tokens)], dtype=np.int64), loss_mask)

    def add_many(self, tokens: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append several samples given as flat arrays (offsets start at 0, relative to `tokens`)."""
        tokens, offsets, loss_mask = np.asarray(tokens), np.asarray(offsets, dtype=np.int64), np.asarray(loss_mask)
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
            raise DatasetError(f"{self.out_dir}: offsets must start at 0, not decrease and end at len(tokens)")
        if len(loss_mask) != len(tokens):
            raise DatasetError(f"{self.out_dir}: loss mask has {len(loss_mask)} entries for {len(tokens)} tokens "
                               f"(sample {self.num_samples} onwards)")
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise DatasetError(f"{self.out_dir}: token id out of [0, {self.vocab_size}) "
                               f"(sample {self.num_samples} onwards)")
        if len(loss_mask) and loss_mask.max() > 1:
            raise DatasetError(f"{self.out_dir}: loss mask values must be 0 or 1")
        self._files[TOKENS].write(tokens.astype(np.uint32, copy=False).tobytes())
        self._files[LOSS_MASK].write(loss_mask.astype(np.uint8, copy=False).tobytes())
        self._files[OFFSETS].write((offsets[1:] + self.num_tokens).tobytes())
        self.num_samples += len(offsets) - 1
        self.num_tokens += len(tokens)
        self.num_supervised += int(np.count_nonzero(loss_mask))

    def commit(self, meta: dict[str, Any] | None = None) -> Path:
        """Flush and fsync the arrays, write meta.json last, rename into place. Returns out_dir."""
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        full = dict(meta or {})
        full.update(format_version=FORMAT_VERSION, num_samples=self.num_samples, num_tokens=self.num_tokens,
                    vocab_size=self.vocab_size, num_supervised_tokens=self.num_supervised)
        with open(self.tmp / META, "w") as f:
            json.dump(full, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        self._dir.commit(synced=True)  # every file was fsynced above, through the handles held open
        log.info("wrote %s: %d samples, %d tokens", self.out_dir, self.num_samples, self.num_tokens)
        return self.out_dir

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        self._dir.abort()


def write_dataset(out_dir: str | os.PathLike,
                  data: TokenDataset | Iterable[tuple[np.ndarray, np.ndarray]],
                  *, vocab_size: int | None = None, meta: dict[str, Any] | None = None,
                  overwrite: bool = False) -> Path:
    """Write a TokenDataset (its arrays) or an iterable of (tokens, loss_mask) samples, atomically."""
    if isinstance(data, TokenDataset):
        vocab_size = data.vocab_size if vocab_size is None else vocab_size
    if vocab_size is None:
        raise ValueError("write_dataset: vocab_size is required when writing from an iterable of samples")
    with DatasetWriter(out_dir, vocab_size=vocab_size, overwrite=overwrite) as w:
        if isinstance(data, TokenDataset):
            w.add_many(data.tokens, data.offsets, data.loss_mask)
        else:
            for tokens, mask in data:
                w.add(tokens, mask)
        return w.commit(meta)


# ----------------------------------------------------------------------------------------- reading

def _read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / META
    if not meta_path.is_file():
        raise DatasetError(f"{meta_path}: missing (not a prepared dataset, or an interrupted write)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{meta_path}: unreadable: {exc}") from exc
    if not isinstance(meta, dict):
        raise DatasetError(f"{meta_path}: expected a JSON object")
    for key in REQUIRED_META:
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            raise DatasetError(f"{meta_path}: key '{key}' must be a non-negative integer, got {meta.get(key)!r}")
    if meta["format_version"] != FORMAT_VERSION:
        raise DatasetError(f"{meta_path}: format_version {meta['format_version']} (this code reads {FORMAT_VERSION})")
    return meta


def _map(path: Path, name: str, count: int) -> np.ndarray:
    """Read-only memmap of `count` items, after checking the file holds exactly that many bytes."""
    f = path / name
    if not f.is_file():
        raise DatasetError(f"{f}: missing")
    dtype = DTYPES[name]
    size, want = f.stat().st_size, count * dtype.itemsize
    if size != want:
        what = "truncated" if size < want else "too long"
        raise DatasetError(f"{f}: {what}: {size} bytes, meta.json implies {want} ({count} x {dtype.name})")
    if count == 0:
        return np.zeros(0, dtype=dtype)  # mmap cannot map an empty file
    return np.memmap(f, dtype=dtype, mode="r", shape=(count,))


def _sample_of(offsets: np.ndarray, token_pos: int) -> int:
    return int(np.searchsorted(offsets, token_pos, side="right")) - 1


def _check_offsets(path: Path, offsets: np.ndarray, num_tokens: int) -> None:
    f = path / OFFSETS
    if offsets[0] != 0:
        raise DatasetError(f"{f}: offsets[0] is {int(offsets[0])}, must be 0")
    bad = np.flatnonzero(offsets[1:] < offsets[:-1])
    if len(bad):
        i = int(bad[0])
        raise DatasetError(f"{f}: offsets decrease at sample {i} ({int(offsets[i])} -> {int(offsets[i + 1])})")
    if offsets[-1] != num_tokens:
        raise DatasetError(f"{f}: last offset is {int(offsets[-1])}, meta.json num_tokens is {num_tokens}")


def _check_values(path: Path, name: str, arr: np.ndarray, limit: int, offsets: np.ndarray, what: str) -> None:
    """Every value < limit, checked chunk by chunk (a max per chunk; the position only on failure)."""
    for a in range(0, len(arr), CHUNK):
        chunk = arr[a:a + CHUNK]
        if chunk.max() >= limit:
            pos = a + int(np.argmax(chunk >= limit))
            raise DatasetError(f"{path / name}: {what} {int(arr[pos])} at token {pos} "
                               f"(sample {_sample_of(offsets, pos)}) is >= {limit}")


def open_dataset(path: str | os.PathLike) -> DiskDataset:
    """Open a prepared dataset read-only, validating it; raises DatasetError naming the bad file."""
    path = Path(path)
    if path.name.startswith(".") and TMP_TAG in path.name:
        raise DatasetError(f"{path}: the temporary directory of an unfinished write (safe to delete)")
    if not path.is_dir():
        raise DatasetError(f"{path}: not a directory (expected a dataset written by dflash_dist.data.prepare)")
    meta = _read_meta(path)
    n, t = meta["num_samples"], meta["num_tokens"]
    offsets = _map(path, OFFSETS, n + 1)
    tokens = _map(path, TOKENS, t)
    loss_mask = _map(path, LOSS_MASK, t)
    _check_offsets(path, offsets, t)
    _check_values(path, TOKENS, tokens, meta["vocab_size"], offsets, "token id")
    _check_values(path, LOSS_MASK, loss_mask, 2, offsets, "loss mask value")
    return DiskDataset(tokens=tokens, offsets=offsets, loss_mask=loss_mask, vocab_size=meta["vocab_size"],
                       meta=meta, path=str(path))
