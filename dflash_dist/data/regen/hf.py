"""The transformers engine: batched generate() with left padding, one process, one device.

It is the reference the vLLM engine is checked against (float32 greedy: the same ids) and the fallback
where vLLM is not installed; at scale it is the slow path (no paged KV cache, no continuous batching:
a batch runs as long as its longest reply).

Sampling draws each reply's tokens from its own generator, seeded with the request's seed (its --seed,
line and turn), so a reply does not depend on which replies share its batch, the batch size or the
chunking; transformers' own sampling draws a whole batch from the global generator, which ties every
reply to its batch. `PerReplySampler` does the drawing inside a greedy generate().
"""
from __future__ import annotations

import logging

import torch

from dflash_dist.data.regen.engine import EngineSpec, Generated, OnReply, Request, Sampling, finish, serve_in_waves
from dflash_dist.models.decode import one_cpu_thread

log = logging.getLogger(__name__)


def _dtype(name: str, device: torch.device):
    if name == "auto":
        return torch.float32 if device.type == "cpu" else "auto"
    return getattr(torch, name)


class PerReplySampler:
    """A logits processor for greedy generate(): temperature and top-p as transformers applies them, then
    one token drawn per row from that row's generator; every other logit is set to -inf, so the greedy
    argmax takes the drawn token."""

    def __init__(self, sampling: Sampling, seeds: list[int], device: torch.device):
        self.temperature, self.top_p = sampling.temperature, sampling.top_p
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:  # keep the most likely tokens up to top_p of the mass (always at least one)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p  # transformers: mass before it >= top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        picked = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, picked[:, None], 0.0)


class HfEngine:
    def __init__(self, spec: EngineSpec, stop_ids: list[int], local_rank: int = 0):
        from transformers import AutoModelForCausalLM
        self.device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(spec.target, dtype=_dtype(spec.dtype, self.device))
        self.model.to(self.device).eval()
        self.stop_ids = frozenset(stop_ids)
        self.batch_size = spec.batch_size
        self.context_len = spec.max_model_len or int(self.model.config.max_position_embeddings)
        # Padding never reaches a reply (masked, then cut off by finish()); any id works.
        self.pad_id = min(stop_ids)
        log.info("hf engine: %s on %s, %s, context %d", spec.target, self.device, self.model.dtype, self.context_len)

    def serve(self, requests: list[Request], sampling: Sampling, on_reply: OnReply) -> None:
        serve_in_waves(self, requests, sampling, on_reply)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 seeds: list[int]) -> list[Generated]:
        out: list[Generated | None] = [None] * len(prompts)
        # Similar lengths share a batch: less padding, and a batch's replies end at similar times.
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), -max_tokens[i]))
        with one_cpu_thread(self.device), torch.inference_mode():
            for b in range(0, len(order), self.batch_size):
                idx = order[b:b + self.batch_size]
                for i, g in zip(idx, self._batch([prompts[i] for i in idx], [max_tokens[i] for i in idx],
                                                 sampling, [seeds[i] for i in idx])):
                    out[i] = g
        return out  # type: ignore[return-value]

    def _batch(self, prompts: list[list[int]], limits: list[int], sampling: Sampling,
               seeds: list[int]) -> list[Generated]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        sampler = [] if sampling.temperature == 0 else [PerReplySampler(sampling, seeds, self.device)]
        # Greedy either way (the sampler draws); the target's generation_config sampling settings are off.
        gen = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max(limits),
            do_sample=False, temperature=None, top_p=None, top_k=None, logits_processor=sampler,
            eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id)
        new = gen[:, width:].tolist()
        return [finish(row, lim, self.stop_ids) for row, lim in zip(new, limits)]
