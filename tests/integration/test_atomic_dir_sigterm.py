"""The one atomic directory write (io/files.py AtomicDir) under SIGTERM at its narrowest
window: the signal lands right after the temporary directory is created, before any statement of the
writer could arm its clean-up (issue 46, case 10: prepare left a `.ds.tmp-*` beside --output once under
load). The window is widened deterministically: a wrapper makes the process SIGTERM itself inside the
temporary's mkdir, then runs the real command-line job; the job must exit 143 and leave nothing beside
its output, for each stage that writes through AtomicDir with terminate_cleanly (prepare's DatasetWriter,
the export's model folder)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from chat_fixtures import (
    CONV,
    openai,
    tok_dir,  # noqa: F401  (fixtures)
    write_jsonl,
)

WRAPPER = textwrap.dedent('''
    import os, pathlib, runpy, signal, sys
    real = pathlib.Path.mkdir
    def mkdir(self, *a, **k):
        real(self, *a, **k)
        if ".tmp-" in self.name:  # the temporary exists now: SIGTERM lands before the next statement
            os.kill(os.getpid(), signal.SIGTERM)
    pathlib.Path.mkdir = mkdir
    if sys.argv[1] == "-c":
        exec(sys.argv[2])
    else:
        sys.argv = sys.argv[1:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
''')

EXPORT = textwrap.dedent('''
    import sys, torch
    from dflash_dist.io.files import terminate_cleanly
    from dflash_dist.config import load_config
    from dflash_dist.models.build import build_drafter, build_target, draft_spec
    from dflash_dist.models.export import export_drafter
    terminate_cleanly()  # as the command-line jobs do
    cfg = load_config(overrides=["objective.block_size=4"])
    target = build_target(cfg, torch.device("cpu"))
    d = build_drafter(draft_spec(cfg, target), target, seed=1, device=torch.device("cpu"))
    export_drafter(d.spec, d.state_dict(), sys.argv[3], dtype=torch.float32)
''')


def run_wrapped(tmp_path, *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "sigterm_at_mkdir.py"
    wrapper.write_text(WRAPPER)
    return subprocess.run([sys.executable, str(wrapper), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stage", ["prepare", "export"])
def test_a_sigterm_right_after_the_temporary_is_made_leaves_nothing(tok_dir, tmp_path, stage):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    if stage == "prepare":
        src = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(openai(CONV))] * 20)
        r = run_wrapped(tmp_path, "dflash_dist.data.prepare", "--tokenizer", str(tok_dir), "--input", str(src),
                        "--output", str(out))
    else:
        r = run_wrapped(tmp_path, "-c", EXPORT, str(out))
    assert r.returncode == 143, r.stderr[-3000:]
    assert "SIGTERM" in r.stderr
    assert sorted(p.name for p in work.iterdir()) == [], r.stderr[-3000:]  # no `.out.tmp-*` left
