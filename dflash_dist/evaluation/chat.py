"""The target's chat template: conversations become token ids, answers become the next turn's context.

Each turn is rendered from the whole conversation so far (user turns and the target's own decoded
answers) with the generation prompt and the thinking switch (`enable_thinking`, which Qwen3's template
reads; templates without it ignore it), then tokenized without adding special tokens again (the
template already holds them: Llama 3's would otherwise start with two BOS). An answer ends where a
regenerated training reply ends (`data.regen.chat.stop_token_ids`: generation_config's EOS ids, the
tokenizer's EOS and the template's one-token end-of-turn marker), which is where the engines stop too.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash_dist.data.regen.chat import stop_token_ids
from dflash_dist.evaluation.prompts import EvalInputError

log = logging.getLogger(__name__)


class Chat:
    def __init__(self, model_dir: str | Path, thinking: bool):
        self.thinking, path = thinking, Path(model_dir)
        try:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # no tokenizer files, a damaged tokenizer.json: the path is what to fix
            raise EvalInputError(f"model.target.path={path}: no usable tokenizer for text prompts "
                                 f"({type(exc).__name__}: {exc})") from exc
        if not getattr(self.tok, "chat_template", None):
            raise EvalInputError(f"model.target.path={path}: the tokenizer has no chat template; conversation "
                                 "prompts need one (token-id prompt files do not)")
        gen = path / "generation_config.json"
        try:
            self.stop = frozenset(stop_token_ids(self.tok, json.loads(gen.read_text()) if gen.is_file() else None))
        except ValueError as exc:
            log.warning("%s: %s", path, exc)
            self.stop = frozenset()

    def render(self, messages: list[dict], where: str) -> list[int]:
        """Token ids of the conversation so far, ending with the assistant's generation prompt."""
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=self.thinking)
            ids = self.tok.encode(text, add_special_tokens=False)
        except Exception as exc:  # a template that raises, a lone surrogate the tokenizer refuses
            raise EvalInputError(f"{where}: the chat template or tokenizer refuses this conversation "
                                 f"({type(exc).__name__}: {exc})") from exc
        if not ids:
            raise EvalInputError(f"{where}: the conversation renders to no tokens")
        return list(ids)

    def answer(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
