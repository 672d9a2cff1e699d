"""Bad input to the real `python -m dflash_dist.evaluate` process: exit 2 naming the file and line,
no traceback."""
from __future__ import annotations

import subprocess
import sys

from evaluate_fixtures import (
    B4,
    draft,  # noqa: F401  (fixtures)
    prompts,
)


def test_exit_code_of_the_real_command(tmp_path, draft):
    """The same through the module entry point, as a user runs it: exit 2, the file named, no traceback."""
    path = prompts(tmp_path, "[1, 2]\n[1000]\n")
    res = subprocess.run([sys.executable, "-m", "dflash_dist.evaluate", "--draft", str(draft), "--bench", path, B4],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"{path}:2: token id 1000" in res.stderr and "Traceback" not in res.stderr
