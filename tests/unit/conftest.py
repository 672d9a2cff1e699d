"""The unit tier is in-process only (docs/architecture.md, tests): every way this process could start
another one (subprocess, os.fork/posix_spawn/system, multiprocessing's start, the spawn helper behind
multiprocessing and torch.multiprocessing) refuses while the tier runs (tests/support/process_guard.py),
and a unit test that tried fails, even where the code under test caught the refusal. A test that truly
needs a process belongs in tests/integration."""
from __future__ import annotations

import pytest
from process_guard import ATTEMPTS, GUARDED, StartedProcess, refuse


@pytest.fixture(scope="session", autouse=True)
def no_process_starts(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for owner, name, what in GUARDED:
        mp.setattr(owner, name, refuse(what))
    # matplotlib builds its font list on first use and asks fontconfig (`fc-list`, a process) for the
    # system's fonts: built once here, into a cache of the tier's own (the user's is not touched), with
    # fontconfig refused as absent, so that the figures' tests start no process either.
    mp.setenv("MPLCONFIGDIR", str(tmp_path_factory.mktemp("matplotlib")))
    import matplotlib.font_manager  # noqa: F401
    ATTEMPTS.clear()
    yield
    mp.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test whose code started (tried to start) a process fails, even where the refusal was caught."""
    ATTEMPTS.clear()
    outcome = yield
    if ATTEMPTS and outcome.excinfo is None:
        outcome.force_exception(StartedProcess(
            f"the unit tier starts no process; this test tried: {', '.join(ATTEMPTS)} (move it to "
            "tests/integration, or keep the code under test in-process)"))
