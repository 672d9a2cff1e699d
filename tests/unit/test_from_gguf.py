"""python -m dflash_dist.models.from_gguf: a GGUF chat model -> a transformers directory."""
import json

import pytest

from dflash_dist.models import from_gguf
from gguf_fixtures import write_gguf


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
        raise OSError("disk full")


def test_a_failed_write_leaves_no_out_dir_and_no_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(from_gguf, "load_gguf", lambda path: (tiny_llama(), FailingTokenizer()))
    with pytest.raises(OSError, match="disk full"):
        from_gguf.convert(write_gguf(tmp_path / "m.gguf", "llama"), tmp_path / "target")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


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


