"""Work in chunks of input lines, written atomically, so a stopped or killed run resumes where it was.

    OUTPUT.parts/key.json             what the chunks depend on; a rerun with other settings is refused
    OUTPUT.parts/chunk-000012.jsonl   the output lines of input lines [12*C, 13*C), in input order
    OUTPUT.parts/chunk-000012.json    its counts; written last, so it marks the chunk as finished
    OUTPUT.parts/progress-rank3.json  rank 3's running totals (for rank 0's progress line)

Chunk c belongs to rank c mod world (the chunk index fixes its content; the world size only who does
it, so a resume may use another number of ranks). When every chunk is finished, rank 0 writes OUTPUT's
meta file, then OUTPUT (both atomically), then removes the parts directory: a failure anywhere before
OUTPUT appears leaves the parts, which the same command merges again.

A write that fails (a full disk, a quota, a read-only remount) raises WriteError naming the file, after
removing the temporary file it was writing: nothing hidden is left behind, and what was written before
is whole, so the same command resumes once there is room.
"""
from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dflash_dist.io.files import TMP_TAG, atomic_write, write_json

log = logging.getLogger(__name__)


class KeyMismatch(ValueError):
    pass


class WriteError(OSError):
    """A file of the run could not be written; the message names it. Bad input for the exit code (2): the
    place must be fixed (room made), not the run retried as it is."""


@contextmanager
def writing(path: Path):
    """Turn an OSError while writing `path` into WriteError naming it (atomic_write has removed its temporary)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, WriteError):
            raise
        raise WriteError(exc.errno, f"cannot write {path}: {exc.strerror or exc}; what was finished before is "
                                    "kept: make room and rerun the same command to resume") from exc


def save_json(path: Path, obj: Any) -> None:
    with writing(path):  # write_json removes its own temporary file on failure
        write_json(path, obj)


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def meta_path(output: Path) -> Path:
    """OUTPUT's meta file beside it: chats.jsonl -> chats.meta.json."""
    return output.with_name(output.stem + ".meta.json")


def chunk_paths(parts: Path, c: int) -> tuple[Path, Path]:
    return parts / f"chunk-{c:06d}.jsonl", parts / f"chunk-{c:06d}.json"


def count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")  # a last line without its newline is a line


def claim(parts: Path, key: dict[str, Any]) -> None:
    """Create the parts directory for `key`, or check that the one there was made with the same key."""
    parts.mkdir(parents=True, exist_ok=True)
    path = parts / "key.json"
    if not path.exists():
        save_json(path, key)  # ranks racing here write the same content; the rename is atomic
    old = json.loads(path.read_text())
    if old != key:
        diff = sorted(k for k in set(old) | set(key) if old.get(k) != key.get(k))
        raise KeyMismatch(f"{parts} holds chunks of another job (differs in {', '.join(diff)}): rerun with the "
                          f"same arguments to resume it, or remove {parts} to start over")


def finished(parts: Path, c: int) -> bool:
    return chunk_paths(parts, c)[1].is_file()


def chunk_lines(path: Path, chunk_size: int, todo: set[int]) -> Iterator[tuple[int, list[tuple[int, bytes]]]]:
    """(chunk, [(line number from 1, raw line)]) for the chunks in `todo`, in order, reading once."""
    lines: list[tuple[int, bytes]] = []
    c = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            c = (line_no - 1) // chunk_size
            if c in todo:
                lines.append((line_no, raw))
            if line_no % chunk_size == 0 and lines:
                yield c, lines
                lines = []
    if lines:
        yield c, lines


def write_chunk(parts: Path, c: int, out_lines: list[str], counts: dict[str, Any]) -> None:
    """The chunk's lines, then its counts: a chunk with a counts file is whole."""
    data, done = chunk_paths(parts, c)
    with writing(data):
        atomic_write(data, lambda f: f.writelines((line + "\n").encode("utf-8") for line in out_lines))
    save_json(done, counts)


def read_counts(parts: Path, c: int) -> dict[str, Any]:
    return json.loads(chunk_paths(parts, c)[1].read_text())


def merge(parts: Path, output: Path, num_chunks: int, meta: dict[str, Any]) -> None:
    """Write OUTPUT's meta file, then the chunks concatenated into OUTPUT (atomically), then remove the
    parts. The meta first: OUTPUT's existence is what a rerun reads as "done", so it must come last."""
    for stale in output.parent.glob(f".{output.name}{TMP_TAG}*"):  # a killed merge's (the caller holds the run lock)
        stale.unlink(missing_ok=True)
    save_json(meta_path(output), meta)
    with writing(output):
        atomic_write(output, lambda out: concatenate(parts, num_chunks, out))
    shutil.rmtree(parts)


def concatenate(parts: Path, num_chunks: int, out) -> None:
    """The chunks' lines into the open file `out`, in chunk order, 16 MiB at a time."""
    for c in range(num_chunks):
        with open(chunk_paths(parts, c)[0], "rb") as f:
            shutil.copyfileobj(f, out, 1 << 24)
