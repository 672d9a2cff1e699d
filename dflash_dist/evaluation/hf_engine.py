"""The hf engine: the project's own KV-cached decoder (`speculative`), prompt by prompt, on one rank or
split over the ranks of a torchrun job (prompt i of a set goes to rank i % world; rank 0 gathers the
counts, which are integers, so the result equals a one-rank run's; only the timings differ).

Each answer is decoded twice: by the target alone (the reference output and the baseline time) and
speculatively; the two must be equal token for token (`exact`). A multi-turn conversation continues
with the speculative answer, decoded to text, as the next turn's context.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from dflash_dist.evaluation.chat import Chat
from dflash_dist.evaluation.prompts import EvalInputError, PromptSet
from dflash_dist.evaluation.results import Tally, answer_digest
from dflash_dist.evaluation.speculative import speculative, target_greedy

log = logging.getLogger(__name__)


class SpeculativeMismatch(RuntimeError):
    """Speculative decoding did not reproduce the target's greedy output."""


@dataclass(frozen=True)
class Options:
    max_new_tokens: int
    strict: bool = False  # a mismatch fails the evaluation instead of being counted
    proposer: Callable | None = None  # `speculative`'s (None: the drafter's own, ContextDrafter)


def decode_answer(target, drafter, prompt: list[int], stop: frozenset, opts: Options, where: str):
    """(Tally of this one answer, its tokens). The answer stops at the target's context, as regeneration's do."""
    new_tokens = answer_budget(len(prompt), target.max_position_embeddings, opts.max_new_tokens, where)
    ref = target_greedy(target, prompt, new_tokens, stop)
    out = speculative(target, drafter, prompt, new_tokens, stop, proposer=opts.proposer)
    t = Tally(drafter.spec.step_tokens, num_turns=1, new_tokens=len(out.tokens), target_s=ref.seconds,
              speculative_s=out.seconds, answer_digests=[answer_digest(out.tokens)])
    t.add_steps(out.accepted)
    if out.tokens != ref.tokens:
        first = next((k for k, (x, y) in enumerate(zip(out.tokens, ref.tokens)) if x != y),
                     min(len(out.tokens), len(ref.tokens)))
        msg = f"{where}: speculative output differs from the target's greedy output at new token {first}"
        if opts.strict:
            raise SpeculativeMismatch(msg)
        log.warning("%s", msg)
        t.mismatches = 1
    return t, out.tokens


def run_prompt(target, drafter, pset: PromptSet, i: int, chat: Chat | None, opts: Options) -> Tally:
    """One prompt of a set: a token-id prompt (fixed length, no stop token) or a whole conversation."""
    where = f"{pset.source}:{pset.lines[i]}"
    total = Tally(drafter.spec.step_tokens, num_prompts=1)
    if pset.kind == "ids":
        t, _ = decode_answer(target, drafter, pset.items[i], frozenset(), opts, where)
        total.merge(t)
        return total
    messages: list[dict] = []
    for k, turn in enumerate(pset.items[i]):
        messages.append({"role": "user", "content": turn})
        ids = chat.render(messages, f"{where} turn {k + 1}")
        t, out = decode_answer(target, drafter, ids, chat.stop, opts, f"{where} turn {k + 1}")
        messages.append({"role": "assistant", "content": chat.answer(out)})
        total.merge(t)
    return total


def answer_budget(prompt_len: int, ctx: int, max_new: int, where: str) -> int:
    """New tokens an answer may take: at most `max_new`, and it stops at the target's context, as
    regeneration's do. A prompt that fills the context is an input error (a later turn, grown by the
    answers before it: first turns are checked up front by check_context). Both engines' rule."""
    if prompt_len >= ctx:
        raise EvalInputError(f"{where}: prompt of {prompt_len:,} tokens >= the target's context of {ctx:,} positions")
    return min(max_new, ctx - prompt_len)


def check_context(ctx: int, sets: list[PromptSet], chat: Chat | None) -> None:
    """EvalInputError naming every prompt whose (first turn's) prompt fills the target's context of `ctx`
    positions, before anything is decoded (both engines): the target cannot answer it (regeneration skips
    such a prompt as over_context)."""
    over = []
    for pset in sets:
        for i, item in enumerate(pset.items):
            where = f"{pset.source}:{pset.lines[i]}"
            n = len(item) if pset.kind == "ids" else len(chat.render([{"role": "user", "content": item[0]}],
                                                                     f"{where} turn 1"))
            if n >= ctx:
                over.append(f"{where} ({n:,} tokens)")
    if over:
        raise EvalInputError(f"{len(over)} prompt(s) of at least the target's context of {ctx:,} positions, which it "
                             f"cannot answer: {', '.join(over[:10])}{', ...' if len(over) > 10 else ''}; remove them "
                             f"from the set")


def warm_up(target, drafter) -> None:
    """One short decode each way before anything is timed (first-call allocations, kernel selection)."""
    prompt = [i % target.vocab_size for i in range(1, 9)]
    target_greedy(target, prompt, 4)
    speculative(target, drafter, prompt, 4)


def run_sets(target, drafter, sets: list[PromptSet], chat: Chat | None, opts: Options,
             rank: int = 0, world: int = 1) -> dict[str, Tally] | None:
    """Tallies per set on rank 0 (None on the other ranks). A bad input or a strict mismatch on any
    rank travels with the gathered results, so every rank returns or raises together (none waits)."""
    check_context(target.max_position_embeddings, sets, chat)  # every rank alike, before any decode or collective
    warm_up(target, drafter)
    local, failure = [], None
    try:
        for s, pset in enumerate(sets):
            for i in range(rank, len(pset.items), world):
                local.append((s, i, run_prompt(target, drafter, pset, i, chat, opts)))
                log.info("%s: prompt %d/%d done", pset.name, i + 1, len(pset.items))
    except (EvalInputError, SpeculativeMismatch) as exc:
        failure = exc
    parts = [(local, failure)]
    if world > 1:
        parts = [None] * world if rank == 0 else None
        dist.gather_object((local, failure), parts, dst=0)
        if rank != 0:
            if failure is not None:
                raise failure
            return None
    for _, exc in parts:
        if exc is not None:
            raise exc
    tallies = {pset.name: Tally(drafter.spec.step_tokens) for pset in sets}
    for s, i, t in sorted((r for part, _ in parts for r in part), key=lambda r: r[:2]):
        tallies[sets[s].name].merge(t)
    return tallies
