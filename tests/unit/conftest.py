"""The unit tier is in-process only (docs/architecture.md, tests): every way this process could start
another one (subprocess, os.fork/posix_spawn/system, multiprocessing's start, the spawn helper behind
multiprocessing and torch.multiprocessing) refuses while the tier runs, and a unit test that tried fails
even where the code under test caught the refusal. A test that truly needs a process belongs in
tests/integration."""
from __future__ import annotations

import pytest

from process_guard import ATTEMPTS, GUARDED, refuse


@pytest.fixture(scope="session", autouse=True)
def no_process_starts():
    mp = pytest.MonkeyPatch()
    for owner, name, what in GUARDED:
        mp.setattr(owner, name, refuse(what))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def started_no_process():
    ATTEMPTS.clear()
    yield
    if ATTEMPTS:
        pytest.fail(f"the unit tier starts no process; this test tried: {', '.join(ATTEMPTS)}")
