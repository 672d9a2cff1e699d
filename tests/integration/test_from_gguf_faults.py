"""The real `python -m dflash_dist.models.from_gguf` process against what can go wrong around OUT_DIR: a
read-only directory, SIGTERM and SIGKILL mid-conversion, two conversions into one OUT_DIR at once. The
slow part, transformers' GGUF load, is stubbed in the process (DRIVER) with a tiny model where a test needs
it to finish; the checks, the claim, the writes and the exit codes are the command's own."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from gguf_fixtures import write_gguf
from helpers import read_only

# from_gguf.main in a process whose load_gguf waits until the file GO exists and returns a tiny llama: the
# stand-in for a real GGUF's load, which takes seconds to minutes.
DRIVER = """
import sys, time
from pathlib import Path
from dflash_dist.models import from_gguf

def load(path):
    go = Path(sys.argv[1])
    while not go.exists():
        time.sleep(0.05)
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2
        def save_pretrained(self, d):
            (Path(d) / "tokenizer.json").write_text("{}")
    return LlamaForCausalLM(cfg).eval(), Tok()

from_gguf.load_gguf = load
sys.exit(from_gguf.main(sys.argv[2:]))
"""


def start(go, gguf, out):
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(go), str(gguf), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_claim(proc, out, timeout=60):
    """Until proc's temporary of `out` holds its marker (the conversion's claim)."""
    deadline = time.monotonic() + timeout
    while not list(out.parent.glob(f".{out.name}.tmp-{proc.pid}-*/from_gguf.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.05)


def test_out_dir_in_a_read_only_directory_exits_2_naming_it_before_loading(tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", "llama")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    with read_only(shelf):  # root: immutable, since permission bits do not stop root
        r = subprocess.run([sys.executable, "-m", "dflash_dist.models.from_gguf", str(gguf), str(shelf / "out")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"OUT_DIR's directory {shelf}: cannot write in it" in r.stderr and "Traceback" not in r.stderr
    assert list(shelf.iterdir()) == []


def test_sigterm_mid_conversion_leaves_nothing_and_a_rerun_after_sigkill_cleans_up(tmp_path):
    gguf, out, go = write_gguf(tmp_path / "m.gguf", "llama"), tmp_path / "target", tmp_path / "go"
    proc = start(go, gguf, out)
    wait_for_claim(proc, out)  # loading, its temporary beside OUT_DIR
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]

    proc = start(go, gguf, out)
    wait_for_claim(proc, out)
    proc.kill()
    proc.communicate(timeout=60)
    assert len(list(tmp_path.glob(".target.tmp-*"))) == 1  # SIGKILL gives no chance to clean up
    go.touch()
    rerun = start(go, gguf, out)
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err[-2000:]
    assert "removed what killed writers of" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "m.gguf", "target"]


def test_a_second_conversion_into_an_out_dir_being_written_exits_2_naming_the_first(tmp_path):
    a, b = write_gguf(tmp_path / "a.gguf", "llama"), write_gguf(tmp_path / "b.gguf", "qwen2")
    out, go = tmp_path / "target", tmp_path / "go"
    first = start(go, a, out)
    wait_for_claim(first, out)
    second = start(go, b, out)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err[-2000:]
    assert f"is being written by another conversion (pid {first.pid}, of {a.resolve()})" in err
    go.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert json.loads((out / "from_gguf.json").read_text())["source"] == str(a.resolve())


def test_two_conversions_started_together_one_writes_the_other_exits_2(tmp_path):
    a, b = write_gguf(tmp_path / "a.gguf", "llama"), write_gguf(tmp_path / "b.gguf", "qwen2")
    out, go = tmp_path / "target", tmp_path / "go"
    go.touch()
    procs = {a: start(go, a, out), b: start(go, b, out)}
    ends = {g: (p.wait(timeout=120), p.communicate()[1]) for g, p in procs.items()}
    codes = sorted(rc for rc, _ in ends.values())
    assert codes == [0, 2], {str(g): e[-1500:] for g, (_, e) in ends.items()}
    winner = next(g for g, (rc, _) in ends.items() if rc == 0)
    loser_err = next(e for rc, e in ends.values() if rc == 2)
    assert str(winner.resolve()) in loser_err and "Traceback" not in loser_err
    assert json.loads((out / "from_gguf.json").read_text())["source"] == str(winner.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "go", "target"]


# The weights' write meets a full disk as safetensors 0.8 reports one (seen on a full 200 MiB tmpfs): part
# of the file written, then its own SafetensorError, not an OSError, with the OS error in its text.
FULL_DISK = """
import transformers.modeling_utils
from safetensors import SafetensorError

def full(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"half a safetensors file")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

transformers.modeling_utils.safe_save_file = full
"""


def test_a_full_disk_under_safetensors_exits_2_naming_out_dir_and_leaves_nothing(tmp_path):
    """Issue 46, case 12: exit 2 naming OUT_DIR and the lack of space, no traceback, nothing left."""
    gguf, go, out = write_gguf(tmp_path / "m.gguf", "llama"), tmp_path / "go", tmp_path / "target"
    go.touch()
    driver = DRIVER.replace("from_gguf.load_gguf = load", FULL_DISK + "\nfrom_gguf.load_gguf = load")
    r = subprocess.run([sys.executable, "-c", driver, str(go), str(gguf), str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{out}: cannot write it: No space left on device" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "m.gguf"]
