"""python -m dflash_dist.data.prepare on bad input and under signals: a reply's token_ids of another model
is exit 2 naming the file and line; SIGTERM leaves nothing half written, and a rerun after a SIGKILL
removes what the killed run left."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from chat_fixtures import (
    CONV,
    openai,
    tok_dir,  # noqa: F401  (fixtures)
    write_jsonl,
)


def cli(tok_dir, src, out, *extra):
    return [sys.executable, "-m", "dflash_dist.data.prepare", "--tokenizer", str(tok_dir), "--input", str(src),
            "--output", str(out), *extra]


def test_token_ids_outside_the_vocabulary_exit_2_naming_the_file_and_line(tok_dir, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    good = openai(CONV)
    bad = openai(CONV)
    reply = bad["messages"][-1]
    # the reply's own ids and one more that this tokenizer lacks (decode would drop it silently)
    reply["token_ids"] = tok(reply["content"], add_special_tokens=False)["input_ids"] + [len(tok) + 7]
    src = write_jsonl(tmp_path / "regen.jsonl", [json.dumps(good), json.dumps(bad)])
    r = subprocess.run(cli(tok_dir, src, tmp_path / "ds"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{src}:2: message 4: token_ids hold id {len(tok) + 7}, outside the tokenizer's vocabulary" in r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen.jsonl"]  # nothing written, nothing partial


def _start_and_wait_for_the_temporary(cmd, out, tmp_path):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(f".{out.name}.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    return proc


def test_sigterm_leaves_nothing_and_a_rerun_after_sigkill_removes_what_it_left(tok_dir, tmp_path):
    src = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(openai(CONV))] * 3_000)  # a few seconds to tokenize
    out = tmp_path / "ds"
    proc = _start_and_wait_for_the_temporary(cli(tok_dir, src, out), out, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "SIGTERM" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl"]  # the half-written dataset removed

    proc = _start_and_wait_for_the_temporary(cli(tok_dir, src, out), out, tmp_path)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.communicate(timeout=60)
    left = [p.name for p in tmp_path.glob(".ds.tmp-*")]
    assert len(left) == 1
    r = subprocess.run(cli(tok_dir, src, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"removed what killed writers of {out} left: {left[0]}" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "ds"]
