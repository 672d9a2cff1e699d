"""What the driver needs from an inference engine, and how one is chosen.

An engine takes prompts as token ids (both engines see exactly the ids the chat template produced, so
their outputs can be compared token for token) and returns each reply's ids without its end token,
with whether it ended at an end token or at its length limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class EngineSpec:
    """Everything that builds an engine: the same value on every rank."""
    name: str  # "vllm" | "hf"
    target: str  # directory with the weights (and, unless `tokenizer` is given, the tokenizer)
    tokenizer: str
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype on a GPU
    max_model_len: int = 0  # 0: the target's max_position_embeddings
    tensor_parallel: int = 1  # GPUs per engine (vLLM)
    kv_cache_gib: float = 1.0  # CPU only: vLLM's KV cache (else it reserves 90% of host memory)
    gpu_memory_utilization: float = 0.9
    batch_size: int = 64  # hf only: prompts per generate call
    max_num_seqs: int = 0  # vllm only: sequences per engine step (0: vLLM's default, 256 on CPU)


@dataclass
class Generated:
    ids: list[int]  # the reply, its end token removed
    stopped: bool  # True: ended at an end token; False: cut at its token limit


@dataclass
class Request:
    key: object  # the caller's handle (a conversation and its turn)
    prompt: list[int]
    max_tokens: int
    seed: int


# Called when a reply ends; returns the conversation's next request (its next turn), or None.
OnReply = Callable[[Request, Generated], "Request | None"]


class Engine(Protocol):
    context_len: int  # prompt + reply tokens the engine can hold

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 seeds: list[int]) -> list[Generated]:
        """One reply per prompt; reply i has at most max_tokens[i] tokens; seeds[i] fixes its sampling."""
        ...

    def serve(self, requests: list[Request], sampling: Sampling, on_reply: OnReply) -> None:
        """Every request and every request that on_reply returns, until none is left."""
        ...


def serve_in_waves(engine: Engine, requests: list[Request], sampling: Sampling, on_reply: OnReply) -> None:
    """serve() for an engine that only has generate(): the requests in hand form one batch, the next
    requests they lead to the next batch (all conversations' turn t together)."""
    while requests:
        gens = engine.generate([r.prompt for r in requests], [r.max_tokens for r in requests], sampling,
                               [r.seed for r in requests])
        requests = [n for r, g in zip(requests, gens) if (n := on_reply(r, g)) is not None]


def finish(ids: list[int], limit: int, stop_ids: frozenset[int]) -> Generated:
    """A raw generation (it may run past its own limit in a padded batch, or carry its end token) as the
    engines report it: cut to `limit`, then ended at the first end token."""
    ids = list(ids[:limit])
    for i, t in enumerate(ids):
        if t in stop_ids:
            return Generated(ids[:i], True)
    return Generated(ids, False)
