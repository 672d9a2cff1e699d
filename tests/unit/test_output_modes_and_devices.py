"""Issue 36, cases 8 and 12, in the one write (io/files.py): an output that is not a regular file
(a character device like /dev/null, a FIFO) is written through and never replaced by a regular file; and
every file and folder the atomic writes leave (atomic_write, AtomicDir, from_gguf's target) gets the mode
the umask gives, not the 0600/0700 of a writer that goes through a temporary (safetensors, mkdtemp)."""
from __future__ import annotations

import os
import stat
import threading

import gguf_fixtures
import pytest
import torch
from safetensors.torch import save_file

from dflash_dist.io.files import AtomicDir, atomic_write, check_output_path, write_json
from dflash_dist.models import from_gguf


def write_gguf(path):
    """A header-only llama GGUF: convert reads only its header and digest once load_gguf is replaced."""
    return gguf_fixtures.write_gguf(path, "llama")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


class PlainTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(root):
    """{relative path: permission bits} of `root` and everything under it."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def test_atomic_write_gives_the_umask_mode(tmp_path, umask_022):
    atomic_write(tmp_path / "a.json", "{}")
    assert modes(tmp_path)["a.json"] == 0o644


def test_atomic_dir_gives_the_umask_mode_to_what_safetensors_wrote(tmp_path, umask_022):
    with AtomicDir(tmp_path / "export") as d:
        save_file({"w": torch.zeros(2)}, str(d.tmp / "model.safetensors"))  # safetensors leaves 0600
        (d.tmp / "sub").mkdir(mode=0o700)
    assert modes(tmp_path / "export") == {".": 0o755, "model.safetensors": 0o644, "sub": 0o755}


def test_from_gguf_target_is_readable_by_other_users(tmp_path, monkeypatch, umask_022):
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: (tiny_llama(), PlainTokenizer()))
    out = from_gguf.convert(write_gguf(tmp_path / "m.gguf"), tmp_path / "target")
    got = modes(out)
    assert got.pop(".") == 0o755 and got["model.safetensors"] == 0o644
    assert set(got.values()) == {0o644}, got


@pytest.fixture
def char_device(tmp_path):
    """A /dev/null-like character device in tmp (never the real /dev/null: old code run as root would
    replace it); skipped where mknod is not allowed."""
    dev = tmp_path / "null"
    try:
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"mknod: {exc}")
    return dev


def test_a_character_device_is_written_through_not_replaced(char_device):
    assert check_output_path(char_device, "--json") == char_device
    write_json(char_device, {"a": 1})
    assert stat.S_ISCHR(os.stat(char_device).st_mode)
    assert sorted(p.name for p in char_device.parent.iterdir()) == ["null"]  # no temporary left


def test_a_fifo_is_checked_without_blocking_and_written_through(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    checked = []
    t = threading.Thread(target=lambda: checked.append(check_output_path(fifo, "--json")), daemon=True)
    t.start()
    t.join(10)
    assert checked == [fifo], "check_output_path blocked on a FIFO with no reader"
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write(fifo, b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_an_unwritable_device_is_refused_naming_the_flag(char_device):
    os.chmod(char_device, 0o444)
    if os.geteuid() == 0:
        pytest.skip("root writes a read-only device node")
    with pytest.raises(ValueError, match="--json"):
        check_output_path(char_device, "--json")
