"""A failed write as the OSError it stands for, whichever library raised it: the one place where the
project maps a writer's own error type to the errno of the OS failure under it, so that a full disk is
reported like any other (exit 2 naming the path and "No space left on device"), never as a traceback.

- safetensors (`save_file`, and transformers' `save_pretrained` through it) raises `SafetensorError`, a
  plain Exception whose text ends in Rust's form of the OS error: "Error while serializing: I/O error: No
  space left on device (os error 28)" (safetensors 0.8, seen on a full tmpfs).
- torch.save into a file object raises RuntimeError ("unexpected pos ...") with the file's OSError as
  its context; into a path it keeps no errno at all (checkpoints/store.py reads the free space then).
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # std::io::Error's Display, as Rust libraries pass it on


def write_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: `exc` itself, one on its cause or context chain (torch wraps
    its writer's), or one rebuilt from a library error whose text carries the OS error's number
    (safetensors'); None when none is found (not a failed write, or one with no errno)."""
    e: BaseException | None = exc
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError):
            return e
        m = _RUST_OS_ERROR.search(str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
    """Run a library's write so that its errno-like failures leave as the OSError they stand for
    (`write_error`, the library's error as its cause): a caller's `except OSError` then handles a full
    disk in a safetensors or torch write as it does in any other. Other exceptions pass unchanged."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        err = write_error(exc)
        if err is None:
            raise
        raise err from exc
