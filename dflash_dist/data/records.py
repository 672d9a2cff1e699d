"""The files chat data comes in -> (file, record number, record), whatever the format; data.jsonl reads
each record.

    a JSONL file                         one JSON object per line: the raw line (bytes), numbered from 1
    a .parquet file                      one row per record: a dict, numbered from 1
    a `datasets` save_to_disk directory  its rows (a DatasetDict: its "train" split, or its only one)
    a directory of .jsonl/.parquet files each file in turn, sorted by path (other files are ignored, logged)

Parquet files and `datasets` directories are read through Hugging Face `datasets` (imported only then).
A file that is not JSONL (a parquet file without its suffix, gzip, zip, PDF, a JSON array, text) is an
`InputError` naming the file and what it looks like, raised before its first record: read line by line it
would be hundreds of bad_json skips and no sample.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

from dflash_dist.data.jsonl import numbered_lines

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".jsonl", ".parquet")
SNIFF_BYTES = 8192
# File signatures (their first bytes) of what people hand over instead of JSONL.
MAGIC = [(b"PAR1", "a parquet file (name it .parquet to have it read)"),
         (b"\x1f\x8b", "a gzip file (decompress it first: gunzip)"),
         (b"PK\x03\x04", "a zip archive (unpack it first)"),
         (b"%PDF", "a PDF document"),
         (b"\x28\xb5\x2f\xfd", "a zstd file (decompress it first: zstd -d)"),
         (b"BZh", "a bzip2 file (decompress it first: bunzip2)"),
         (b"\xfd7zXZ\x00", "an xz file (decompress it first: unxz)"),
         (b"SQLite format 3\x00", "an SQLite database"),
         (b"ARROW1", "an Arrow IPC file (give its `datasets` save_to_disk directory instead)"),
         (b"\x93NUMPY", "a NumPy array file"),
         (b"\xff\xfe", "UTF-16 text (save it as UTF-8)"), (b"\xfe\xff", "UTF-16 text (save it as UTF-8)")]


class InputError(ValueError):
    """Input the whole run cannot use, named by file (and line): exit 2."""


def sniff(path: Path) -> str | None:
    """What `path` looks like when it is not JSONL, or None when its first non-blank line may be JSONL."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    for magic, what in MAGIC:
        if head.startswith(magic):
            return what
    if b"\x00" in head:
        return "binary data (NUL bytes), not text"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 byte-order mark and blank lines are harmless
    if not text:
        return None
    try:
        text[:SNIFF_BYTES - 4].decode("utf-8")  # 4: a character cut at the end of the sniffed bytes
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if text.startswith(b"["):
        return "a JSON array (one document), not JSONL (one object per line; e.g. jq -c '.[]' FILE)"
    if not text.startswith(b"{"):
        first = text.split(b"\n", 1)[0][:60].decode("utf-8", "replace")
        return f"text that is not JSON (its first line begins {first!r})"
    return None


def _datasets():
    try:
        import datasets  # optional extra: only parquet and `datasets` directories need it
    except ImportError as exc:
        raise InputError("reading parquet files or `datasets` directories needs Hugging Face `datasets`: "
                         "pip install datasets (or pip install 'dflash_dist[dev]')") from exc
    return datasets


def _parquet_rows(path: Path) -> Iterator[dict]:
    # Streamed: rows are read a batch at a time, and nothing is copied into the datasets cache.
    ds = _datasets().load_dataset("parquet", data_files=str(path), split="train", streaming=True)
    try:
        yield from ds
    except Exception as exc:  # not parquet after all, or damaged: the library says why
        raise InputError(f"{path}: cannot read as parquet ({type(exc).__name__}: {exc})") from exc


def _saved_rows(path: Path) -> Iterator[dict]:
    """The rows of a `datasets` save_to_disk directory: one Dataset, or a DatasetDict's train (or only) split."""
    datasets = _datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged or foreign directory: the library says why
        raise InputError(f"{path}: cannot read this `datasets` directory ({type(exc).__name__}: {exc})") from exc
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" not in ds and len(splits) != 1:
            raise InputError(f"{path}: a DatasetDict with splits {splits} and no 'train': give one split's "
                             f"directory (e.g. {path / splits[0]})")
        ds = ds["train" if "train" in ds else splits[0]]
    yield from ds


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a `datasets` save_to_disk directory (a Dataset's or a DatasetDict's)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _file_records(path: Path) -> Iterator[tuple[str, int, Any]]:
    if path.suffix == ".parquet":
        for n, row in enumerate(_parquet_rows(path), start=1):
            yield str(path), n, row
        return
    what = sniff(path)
    if what is not None:
        raise InputError(f"{path}:1: not a JSONL file: it looks like {what}")
    for n, raw in numbered_lines(path):
        yield str(path), n, raw


def data_files(path: Path) -> list[Path]:
    """The .jsonl and .parquet files under a directory, sorted by path; others are logged and left."""
    files = sorted(p for p in path.rglob("*")  # hidden files and folders (.git, .cache) are not data
                   if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts))
    data = [p for p in files if p.suffix in DATA_SUFFIXES]
    left = [str(p.relative_to(path)) for p in files if p.suffix not in DATA_SUFFIXES]
    if left:
        log.info("%s: %d file(s) that are not .jsonl or .parquet are not read: %s", path, len(left),
                 ", ".join(left[:5]) + (", ..." if len(left) > 5 else ""))
    if not data:
        raise InputError(f"{path}: a directory with no .jsonl or .parquet file (and not a `datasets` save_to_disk "
                         "directory)")
    return data


def iter_records(path: str | Path) -> Iterator[tuple[str, int, Any]]:
    """(file name, record number from 1, the raw line's bytes or the row's dict) of every record under
    `path` (module docstring). InputError for a path that is not chat data, before its first record."""
    path = Path(path)
    if path.is_dir():
        if is_saved_dataset(path):
            for n, row in enumerate(_saved_rows(path), start=1):
                yield str(path), n, row
            return
        for f in data_files(path):
            yield from _file_records(f)
        return
    if not path.is_file():
        raise InputError(f"{path}: no such file or directory")
    yield from _file_records(path)
