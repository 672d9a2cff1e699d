"""What the evaluation tests share: a tiny transformers Qwen3 target with a chat-template tokenizer, and a
drafter trained for a few seconds on the target's own greedy continuations, so that acceptance varies
from step to step (a random drafter accepts nothing), exported in the z-lab format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from chat_fixtures import make_tokenizer
from oracles import dflash_loss

from dflash_dist.config import load_config
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.decode import greedy
from dflash_dist.models.export import export_drafter
from dflash_dist.training.objective import block_labels

CPU = torch.device("cpu")
# vLLM's CPU attention takes head sizes of 32 and more.
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False)
BLOCK = 4


def target_overrides(model_dir: Path) -> list[str]:
    return ["model.target.kind=hf", f"model.target.path={model_dir}", "model.target.dtype=float32",
            "model.draft.target_layer_ids=[0,1,2]", f"objective.block_size={BLOCK}"]


def save_target(model_dir: Path) -> Path:
    """Random weights never say "<|end|>", so the end of an answer (generation_config's eos_token_id) is
    the token the model says most often after chat prompts: answers then really end early sometimes."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**SHAPE, bos_token_id=None, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    make_tokenizer(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    said = []
    for text in ("hi", "how are you?", "tell me a story."):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
        said += model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = max(set(said), key=said.count)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(model_dir)
    return model_dir


def _batch(target, gen: torch.Generator, n: int, plen: int, new: int):
    prompts = [torch.randint(5, SHAPE["vocab_size"], (plen,), generator=gen) for _ in range(n)]
    conts = greedy(target, prompts, [new] * n)
    return torch.cat([torch.cat([p, c]) for p, c in zip(prompts, conts)]), plen + new


def train_drafter(target, spec, steps: int = 60, seed: int = 0):
    """Adam on the DFlash loss, anchors at every position of the continuations."""
    gen = torch.Generator().manual_seed(seed)
    drafter = build_drafter(spec, target, seed=seed, device=CPU)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    layer_ids = list(spec.target_layer_ids)
    for _ in range(steps):
        ids, L = _batch(target, gen, n=8, plen=6, new=40)
        S = ids.numel() // L
        cu = torch.arange(S + 1) * L
        pos = torch.arange(L).repeat(S)
        feats, _ = target.capture(ids, cu, pos, layer_ids)
        mask = (pos >= 6)
        anchors = torch.nonzero((pos >= 5) & (pos < L - 1)).squeeze(1)
        per_seq = torch.bincount(anchors // L, minlength=S)
        anchor_cu = torch.cat([torch.zeros(1, dtype=torch.long), per_seq.cumsum(0)])
        labels, weights = block_labels(ids, mask, cu, anchors, anchor_cu, spec.block_size, gamma=4.0)
        logits = drafter.block_logits(feats, ids, cu, pos, anchors, anchor_cu)
        loss, _ = dflash_loss(logits, labels, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def make_export(root: Path) -> tuple[Path, Path]:
    """(target dir, export dir) under root: the target, its tokenizer, and a trained drafter in float32."""
    model_dir = save_target(root / "target")
    cfg = load_config(overrides=target_overrides(model_dir))
    target = build_target(cfg, CPU)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: on a shared 2-core machine more threads only wait for each other
    try:
        drafter = train_drafter(target, draft_spec(cfg, target))
    finally:
        torch.set_num_threads(threads)
    export_drafter(drafter.spec, drafter.state_dict(), root / "draft", dtype=torch.float32)
    return model_dir, root / "draft"


def untrained_export(root: Path, *overrides: str) -> tuple[Path, Path]:
    """(target dir, export dir) under root: the target of save_target and an untrained drafter that fits
    it (of the config's variant), for tests that stop before anything is decoded."""
    model_dir = save_target(root / "target")
    cfg = load_config(overrides=[*target_overrides(model_dir), *overrides])
    target = build_target(cfg, CPU)
    d = build_drafter(draft_spec(cfg, target), target, seed=1, device=CPU)
    return model_dir, export_drafter(d.spec, d.state_dict(), root / "draft", dtype=torch.float32)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TURNS = [{"turns": ["hello there, how are you?", "and what is 2 + 2?"]},
         {"turns": ["write a poem about the sea."]},
         {"turns": ["why is the sky blue?", "explain again.", "once more, briefly."]}]


B4 = "objective.block_size=4"


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    cfg = load_config(overrides=[B4])
    target = build_target(cfg, CPU)
    d = build_drafter(draft_spec(cfg, target), target, seed=1, device=CPU)
    return export_drafter(d.spec, d.state_dict(), tmp_path_factory.mktemp("ev") / "draft", dtype=torch.float32)


def prompts(tmp_path: Path, text: str, name: str = "p.jsonl") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)
