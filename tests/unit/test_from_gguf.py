"""python -m dflash_dist.models.from_gguf: a GGUF chat model -> a transformers directory."""
import errno
import json
import os

import pytest
from gguf_fixtures import write_gguf

from dflash_dist.io import files
from dflash_dist.models import from_gguf


def test_out_dir_holding_something_else_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(from_gguf.ConversionError, match="is not a conversion by this command"):
        from_gguf.convert(write_gguf(tmp_path / "m.gguf", "llama"), out)
    assert (out / "keep.txt").read_text() == "mine"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


class FailingTokenizer:
    def save_pretrained(self, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_bad_input_naming_out_dir_and_leaves_no_out_dir_and_no_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: (tiny_llama(), FailingTokenizer()))
    out = tmp_path / "target"
    with pytest.raises(from_gguf.ConversionError, match=f"{out}: cannot write it: No space left on device"):
        from_gguf.convert(write_gguf(tmp_path / "m.gguf", "llama"), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


# What safetensors 0.8 raises when the disk fills under save_file (seen on a full tmpfs): its own error
# type, not an OSError, with the OS error only in its text.
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_a_full_disk_under_safetensors_exits_2_naming_out_dir_and_the_lack_of_space(tmp_path, monkeypatch, caplog):
    """Issue 46, case 12: transformers' save_pretrained writes the weights with safetensors, whose
    SafetensorError was a traceback (exit 1); it is the same full disk as an OSError's: exit 2."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError(SAFETENSORS_FULL)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: (tiny_llama(), PlainTokenizer()))
    monkeypatch.setattr(from_gguf, "terminate_cleanly", lambda: None)  # pytest's own SIGTERM handling stays
    out = tmp_path / "target"
    assert from_gguf.main([str(write_gguf(tmp_path / "m.gguf", "llama")), str(out)]) == 2
    assert f"{out}: cannot write it: No space left on device" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_full_disk_found_before_loading_exits_2_naming_the_directory(tmp_path, monkeypatch, caplog):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: pytest.fail("loaded despite a full disk"))
    monkeypatch.setattr(files.os, "write", full)  # the start-up probe's write (files.probe_dir)
    monkeypatch.setattr(from_gguf, "terminate_cleanly", lambda: None)  # pytest's own SIGTERM handling stays
    gguf = write_gguf(tmp_path / "m.gguf", "llama")
    assert from_gguf.main([str(gguf), str(tmp_path / "target")]) == 2
    assert f"OUT_DIR's directory {tmp_path}: cannot write in it: No space left on device" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_a_stale_temporary_of_a_killed_run_is_removed_by_the_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: (tiny_llama(), PlainTokenizer()))
    dead = _dead_pid()
    out = tmp_path / "target"
    stale = tmp_path / f".target.tmp-{dead}-{files.HOST_TAG}0badc0de"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    from_gguf.convert(write_gguf(tmp_path / "m.gguf", "llama"), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "target"]


def _dead_pid() -> int:
    """A pid no process has: one above the kernel's largest."""
    return int(open("/proc/sys/kernel/pid_max").read()) + 1


def test_another_conversion_writing_out_dir_is_refused_naming_its_pid_and_gguf(tmp_path, monkeypatch):
    # what a live run converting b.gguf into out leaves beside it: its temporary, claimed by its marker
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: pytest.fail("loaded while another run writes"))
    other = os.getppid()  # a live process of this host
    claim = tmp_path / f".target.tmp-{other}-{files.HOST_TAG}12345678"
    claim.mkdir()
    (claim / from_gguf.MARKER).write_text(json.dumps({"source": "/models/b.gguf", "size": 1, "sha256": "b"}))
    with pytest.raises(from_gguf.ConversionError,
                       match=rf"being written by another conversion \(pid {other}, of /models/b.gguf\)"):
        from_gguf.convert(write_gguf(tmp_path / "a.gguf", "llama"), tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == [claim.name, "a.gguf"]


def test_a_conversion_finished_meanwhile_is_kept_and_this_one_refused(tmp_path, monkeypatch):
    # the race the start-up check cannot see: another run's OUT_DIR appears while this one converts
    out = tmp_path / "target"

    def load_while_another_finishes(path):
        out.mkdir()
        (out / from_gguf.MARKER).write_text(json.dumps({"source": "/models/b.gguf", "size": 1, "sha256": "b"}))
        return tiny_llama(), PlainTokenizer()
    monkeypatch.setattr(from_gguf, "load_gguf", load_while_another_finishes)
    with pytest.raises(from_gguf.ConversionError, match="written meanwhile by another conversion, of /models/b.gguf"):
        from_gguf.convert(write_gguf(tmp_path / "a.gguf", "llama"), out)
    assert json.loads((out / from_gguf.MARKER).read_text())["source"] == "/models/b.gguf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "target"]


class PlainTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def test_rerun_keeps_the_same_conversion_and_refuses_another_gguf(tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: loads.append(path) or (tiny_llama(), PlainTokenizer()))
    first = write_gguf(tmp_path / "a.gguf", "llama")
    out = from_gguf.convert(first, tmp_path / "target")
    marker = json.loads((out / from_gguf.MARKER).read_text())
    assert marker["sha256"] == from_gguf.fingerprint(first)["sha256"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    from_gguf.convert(first, out)  # done: not loaded again
    assert len(loads) == 1
    other = write_gguf(tmp_path / "b.gguf", "qwen2")
    with pytest.raises(from_gguf.ConversionError, match="give --force"):
        from_gguf.convert(other, out)
    from_gguf.convert(other, out, force=True)
    assert len(loads) == 2
    assert json.loads((out / from_gguf.MARKER).read_text())["source"] == str(other.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "target"]


