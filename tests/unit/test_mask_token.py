"""The mask token is chosen deliberately and said (issue 27 item 8): a vocabulary with no mask token and
no unused row (SmolLM2's) gets a spare control token, not its last row, a real word piece."""
import logging

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from dflash_dist.models.head import default_mask_token_id

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _full_vocabulary(path):
    """36 words and 4 added control tokens, every row a token: eos and the template's two, one spare."""
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"w{i}": i for i in range(36)}, unk_token="w0")), eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<empty_output>"]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return fast


def test_a_full_vocabulary_without_a_mask_token_takes_a_spare_control_token(tmp_path, caplog):
    fast = _full_vocabulary(tmp_path)
    assert len(fast) == 40
    with caplog.at_level(logging.INFO, logger="dflash_dist.models.head"):
        mask = default_mask_token_id(tmp_path, vocab_size=40)
    assert mask == fast.convert_tokens_to_ids("<empty_output>") == 39  # not eos, not the template's own
    assert caplog.records[-1].getMessage().startswith("mask token id 39 ('<empty_output>'): a spare control token")


def test_with_no_spare_control_token_the_last_row_is_a_warning(tmp_path, caplog):
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"w{i}": i for i in range(36)}, unk_token="w0")), eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_dist.models.head"):
        assert default_mask_token_id(tmp_path, vocab_size=len(fast)) is None
    assert "the mask is the last row (38), a real token; give model.draft.mask_token_id" in caplog.text
