"""The on-disk dataset after a hard crash (a process killed while writing or before the rename):
nothing is left that opens."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_dist.data.disk import DatasetError, open_dataset

CRASH = """
import os, sys
import numpy as np
from dflash_dist.data import disk
def crash(*a, **k):  # the process dies after every file is written and fsynced, before the rename
    os._exit(9)
disk.os.replace = crash
w = disk.DatasetWriter(sys.argv[1], vocab_size=10)
w.add(np.arange(5), np.ones(5, np.uint8))
w.commit({})
"""


CRASH_MID = """
import os, sys
import numpy as np
from dflash_dist.data import disk
w = disk.DatasetWriter(sys.argv[1], vocab_size=10)
w.add(np.arange(5), np.ones(5, np.uint8))
w._files["tokens.bin"].flush()
os._exit(9)  # killed while streaming samples
"""


@pytest.mark.parametrize("script", [CRASH, CRASH_MID], ids=["before_rename", "while_writing"])
def test_hard_crash_leaves_nothing_that_opens(tmp_path, script):
    out = tmp_path / "ds"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ds.tmp-")  # a hidden, unnamed temporary
    with pytest.raises(DatasetError, match="temporary directory of an unfinished write"):
        open_dataset(leftovers[0])
    if script is CRASH_MID:  # torn: and, whatever its name, it has no meta.json yet
        renamed = leftovers[0].rename(tmp_path / "renamed")
        with pytest.raises(DatasetError, match="meta.json: missing"):
            open_dataset(renamed)
