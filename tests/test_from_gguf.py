"""python -m dflash_dist.models.from_gguf: a GGUF chat model -> a transformers directory."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_dist.models import from_gguf


def write_gguf(path, arch):
    """A header-only GGUF of the given architecture (one dummy tensor): enough for the checks that run
    before any weight is read."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_dist.models.from_gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_missing_file_exits_2_naming_it(tmp_path):
    r = run_cli(tmp_path / "nope.gguf", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "nope.gguf: no such file" in r.stderr
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_exits_2(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf\n")
    r = run_cli(bad, tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "model.gguf: not a readable GGUF file" in r.stderr


def test_unsupported_architecture_exits_2_naming_it(tmp_path):
    r = run_cli(write_gguf(tmp_path / "odd.gguf", "frobnicator"), tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "architecture 'frobnicator' cannot be loaded" in r.stderr and "llama" in r.stderr
    assert not (tmp_path / "out").exists()


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


def test_packaged_smollm2_is_found():
    path = from_gguf.packaged_smollm2()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6
    assert from_gguf.check_supported(path) == "llama"


@pytest.mark.slow
def test_converted_target_generates_what_the_gguf_generates(smollm2_target):
    """The contract: the directory loads with plain transformers (no gguf_file) and its greedy output on a
    chat prompt is the GGUF-loaded model's, token for token; tokenizer, chat template and end of turn kept."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_model, gguf_tok = from_gguf.load_gguf(from_gguf.packaged_smollm2())
    model = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_target)
    gen = GenerationConfig.from_pretrained(smollm2_target)
    assert gen.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 30
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = gguf_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(ids, ref)
    kw = dict(max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, generation_config=gen, **kw)
        want = gguf_model.generate(ref, **kw)
    assert torch.equal(out, want)
    assert "def" in tok.decode(out[0, ids.shape[1]:])  # a real model answering, not noise
