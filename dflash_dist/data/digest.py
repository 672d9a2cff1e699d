"""A dataset's fingerprint: sha256 of its offsets, tokens and loss mask, kept with every checkpoint so
that a resume finds data that changed under it (new tokens of the same lengths included).

Hashed in chunks straight from the arrays (memory-mapped for a prepared dataset): no copy of the
dataset is made. Rank 0 computes it once per start, chunks hashed on up to 8 threads (about 0.5 GB/s of dataset
files per core without SHA instructions, several times that with them).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dflash_dist.io.files import file_sha256

log = logging.getLogger(__name__)

_CHUNK = 1 << 24  # elements per update: bounded temporaries whatever the dataset size


def _chunk_sha(arr: np.ndarray, a: int) -> bytes:
    return hashlib.sha256(memoryview(np.ascontiguousarray(arr[a:a + _CHUNK])).cast("B")).digest()


def _sha256(arr: np.ndarray, pool: ThreadPoolExecutor) -> str:
    """sha256 over the dtype and the sha256 of each chunk in order: chunks hash in parallel (hashlib lets go
    of the GIL), and the result does not depend on the number of threads."""
    h = hashlib.sha256(str(arr.dtype).encode())
    for d in pool.map(lambda a: _chunk_sha(arr, a), range(0, len(arr), _CHUNK)):
        h.update(d)
    return h.hexdigest()


def file_digest(path) -> str:
    """sha256 of a file's bytes, read in chunks (a regeneration's input: its resume key holds it, so an
    edit that keeps the size and mtime is found)."""
    t0 = time.perf_counter()
    digest = file_sha256(path)
    log.info("%s: sha256 of %d bytes in %.1fs", path, os.path.getsize(path), time.perf_counter() - t0)
    return digest


def dataset_digest(ds) -> dict:
    """{"samples", "tokens", "offsets", "loss_mask"}: the sample count and the arrays' sha256 (cached on
    `ds`, which is immutable)."""
    cached = ds.__dict__.get("_dflash_digest")
    if cached is None:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            cached = {"samples": len(ds), **{name: _sha256(np.asarray(getattr(ds, name)), pool)
                                             for name in ("offsets", "tokens", "loss_mask")}}
        ds.__dict__["_dflash_digest"] = cached  # a frozen dataclass: its __dict__ takes a cache entry
        log.info("dataset digest: %d samples, %d tokens hashed in %.1fs", len(ds), len(ds.tokens),
                 time.perf_counter() - t0)
    return cached
