"""One conversation -> token ids and a loss mask: rendering with the target's chat template and finding the
assistant's spans in the rendered text (data.prepare's samples).

How assistant spans are found (character level, then mapped to tokens):
  * The conversation is rendered with the tokenizer's chat template, given what the target is served with
    (the line's `tools`, the template arguments: enable_thinking, ...); that text is what is tokenized and
    trained on.
  * Turn k starts where `render(messages[:k], add_generation_prompt=True)` ends, which must be a prefix of
    the full text (the generation prompt, e.g. "<|im_start|>assistant\\n", is not supervised; with thinking
    off it holds the template's empty <think></think>, so a reply is supervised from its first written token).
  * It ends where `render(messages[:k+1])` ends when that is also a prefix of the full text; otherwise (one
    sample for a template that rewrites earlier turns) at the template's end-of-turn marker (found once by
    rendering a probe conversation), searched from the turn's start. Trailing whitespace is not supervised.
  * So the supervised text is the assistant content (its tool calls as the template writes them included)
    plus the end-of-turn marker, which a drafter must learn to propose. Tool results, user and system turns
    are context. A token is supervised when its first character is.

Turns the template rewrites (`plan_samples`): a reasoning template (Qwen3's) renders a past assistant turn
without its reasoning, which is not how the target wrote it. Such a turn gets a sample of its own, the
conversation up to it as the template shows it, where it is the last turn and rendered as written; turns
a render shows verbatim share it. A template that renders every turn verbatim gives one sample, as before.

Reasoning is the message's reasoning_content (the reader maps `reasoning` and `thinking` to it) or an
inline <think>...</think> block of its content; a turn whose reasoning the template leaves out of its own
sample is counted ("reasoning_left_out"), and the supervised reasoning tokens are counted too.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dflash_dist.data.jsonl import CUT, Skip, template_view

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE = "\u2063dflash-probe\u2063"  # text no real reply contains

Render = Callable[[list, bool], str]


@dataclass(frozen=True)
class Options:
    max_length: int = 0  # 0 = no limit
    last_turn_only: bool = False
    no_reasoning_loss: bool = False
    split_turns: bool = True  # a sample per assistant turn the template rewrites once the conversation goes on
    template_kwargs: dict = field(default_factory=dict)  # given to apply_chat_template (enable_thinking, ...)
    chat_template: str = ""  # a template file to use instead of the tokenizer's own ("" = the tokenizer's)


class ForeignIds(ValueError):
    """A reply's token_ids hold an id the tokenizer does not have: they are another model's."""


def renderer(tokenizer, opts: Options, tools: list | None = None) -> Render:
    """render(messages, generation_prompt) -> text, with the line's tools and the template arguments."""
    kwargs: dict[str, Any] = dict(opts.template_kwargs)
    if tools:
        kwargs["tools"] = tools

    def render(msgs: list, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                             **kwargs)
    return render


def end_of_turn_marker(tokenizer) -> str:
    """What the template writes after an assistant reply (e.g. "<|im_end|>"), or "" if unknown."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template may reject the probe; then only prefix-stable renders work
        return ""
    i = text.rfind(_PROBE)
    return text[i + len(_PROBE):].strip() if i >= 0 else ""


def supervised_turns(messages: list[dict], last_turn_only: bool) -> list[int]:
    """Indices of the assistant turns to train: all but those of weight 0 (OpenAI fine-tuning's context)."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and m.get("weight", 1) != 0]
    return turns[-1:] if last_turn_only else turns


def template_failure(exc: Exception) -> Skip:
    # jinja raises on templates' own checks (e.g. "roles must alternate")
    return Skip("template_error", f"chat template failed: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------------- samples of a conversation

def plan_samples(render: Render, view: list[dict], turns: list[int], split: bool) -> list[tuple[int, list[int]]]:
    """[(last message index, supervised turns)]: the samples of one conversation, in conversation order.
    Without `split`, one sample of the whole conversation. With it, the latest unplaced turn k ends a sample
    rendered from view[:k+1]; every earlier unplaced turn that render shows verbatim (its own render and its
    generation prompt are prefixes of it) is supervised there too; the rest wait for a sample of their own."""
    if not turns:
        return []
    if not split:
        return [(len(view) - 1, list(turns))]
    cache: dict[tuple[int, bool], str] = {}

    def rendered(end: int, gen: bool) -> str:
        if (end, gen) not in cache:
            try:
                cache[end, gen] = render(view[:end], gen)
            except Exception as exc:
                raise template_failure(exc) from exc
        return cache[end, gen]

    pending, plan = sorted(turns), []
    while pending:
        k = pending[-1]
        full = rendered(k + 1, False)
        covered = [j for j in pending if j == k or (full.startswith(rendered(j + 1, False))
                                                    and full.startswith(rendered(j, True)))]
        plan.append((k, covered))
        pending = [j for j in pending if j not in covered]
    return plan[::-1]


# ----------------------------------------------------------------------------------- spans

def assistant_spans(render: Render, messages: list[dict], full: str, eot: str,
                    turns: list[int]) -> list[tuple[int, int, int]]:
    """(message index, start, end): character spans [start, end) of the supervised assistant turns in `full`."""
    spans = []
    for k in turns:
        prompt = render(messages[:k], True)
        if not full.startswith(prompt):
            raise Skip("span_not_found", f"message {k}: the template's generation prompt is not a prefix of "
                                         "the rendered conversation")
        start = len(prompt)
        turn = render(messages[:k + 1], False)
        if full.startswith(turn):
            end = len(turn.rstrip())
        else:  # the template rewrites this turn once later turns follow: end at its end-of-turn marker
            j = full.find(eot, start) if eot else -1
            if j < 0:
                raise Skip("span_not_found", f"message {k}: cannot find the end of this assistant turn")
            end = j + len(eot)
        spans.append((k, start, max(start, end)))
    return spans


def cut_span_end(full: str, start: int, end: int, content: str, eot: str) -> int:
    """Where the supervision of a reply cut at its token limit ends: after its content, before the
    end-of-turn marker the template writes (the target never ended that turn, so no label may say it did)."""
    p = full.find(content, start, end) if content else -1
    if p >= 0:
        return p + len(content)
    if eot and full.endswith(eot, start, end):  # the template rewrote the reply: cut the marker alone
        return end - len(eot)
    return end


def reasoning_blocks(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """<think>...</think> blocks inside [start, end), with the whitespace that follows each."""
    blocks, pos = [], start
    while pos < end:
        o, c = text.find(THINK_OPEN, pos, end), text.find(THINK_CLOSE, pos, end)
        if o < 0 and c < 0:
            break
        # A close with no open before it: the block was opened in the generation prompt.
        b0 = o if o >= 0 and (c < 0 or o < c) else pos
        c = text.find(THINK_CLOSE, b0, end)
        b1 = end if c < 0 else c + len(THINK_CLOSE)  # an unclosed block runs to the end of the turn
        while b1 < end and text[b1].isspace():
            b1 += 1
        blocks.append((b0, b1))
        pos = b1
    return blocks


def reasoning_text(message: dict) -> str:
    """The turn's reasoning as written: its reasoning_content, else the inside of an inline <think> block
    (stripped: templates strip its surrounding newlines, Qwen3's does)."""
    reasoning = (message.get("reasoning_content") or "").strip()
    content = message.get("content") or ""
    if not reasoning and THINK_CLOSE in content:
        reasoning = content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip()
    return reasoning


def reasoning_field(text: str, start: int, end: int, message: dict) -> tuple[int, int] | None:
    """Where the template rendered the message's reasoning inside [start, end), or None (the template left
    it out, e.g. Qwen3 for turns before the last user message)."""
    reasoning = reasoning_text(message)
    p = text.find(reasoning, start, end) if reasoning else -1
    return (p, p + len(reasoning)) if p >= 0 else None


def calls_rendered(text: str, start: int, end: int, calls: list[dict]) -> bool:
    """Whether the template wrote every tool call of a turn inside [start, end): each call's function name
    at least (templates format the arguments their own way)."""
    return all(text.find(c["function"]["name"], start, end) >= 0 for c in calls)


# ----------------------------------------------------------------------------------- one sample

def _char_masks(full: str, spans, messages: list[dict], opts: Options, eot: str,
                notes: Counter) -> tuple[np.ndarray, np.ndarray]:
    """(supervised, reasoning): True on every supervised character of `full`, and on every character of a
    turn's reasoning text where the template rendered it (tags and whitespace around it not counted)."""
    char_mask = np.zeros(len(full) + 1, dtype=bool)  # +1: zero-width tokens at the very end read False
    reasoning = np.zeros(len(full) + 1, dtype=bool)
    unmark = []  # --no-reasoning-loss: the <think> blocks (tags included) and the rendered reasoning
    for k, a, b in spans:
        m = messages[k]
        if m.get("finish_reason") == CUT:
            b = cut_span_end(full, a, b, m["content"], eot)
            notes["cut_replies"] += 1
        if m.get("tool_calls"):
            notes["tool_call_turns"] += 1
            if not calls_rendered(full, a, b, m["tool_calls"]):
                # A template without tools (SmolLM2's) renders the call turn empty: its end-of-turn marker
                # would teach the drafter that the turn ends where the target writes its call.
                notes["tool_calls_not_rendered"] += 1
                continue
        char_mask[a:b] = True
        field_ = reasoning_field(full, a, b, m)
        if reasoning_text(m):
            notes["reasoning_turns"] += 1
            if field_ is None:
                notes["reasoning_left_out"] += 1
                if (m.get("reasoning_content") or "").strip():
                    notes["reasoning_content_not_rendered"] += 1
        if field_:
            reasoning[field_[0]:field_[1]] = True
        unmark += reasoning_blocks(full, a, b) + ([field_] if field_ else [])
    if opts.no_reasoning_loss:
        for r0, r1 in unmark:
            char_mask[r0:r1] = False
    return char_mask, reasoning


def _splice_target_ids(tokenizer, full: str, spans, messages: list[dict], ids: list[int], starts: list[int],
                       ends: list[int], char_mask: np.ndarray, notes: Counter) -> tuple[list[int], np.ndarray]:
    """Token ids and mask with each reply's `token_ids` (what the target generated) in place of the
    re-tokenized reply text, where the template wrote the reply verbatim and the ids decode to it.
    Re-tokenizing text need not give the ids it was decoded from (a model may emit a non-canonical
    tokenization); a reply the template rewrote keeps the re-tokenized text, counted."""
    mask = char_mask[np.asarray(starts, dtype=np.int64)]
    vocab = len(tokenizer)
    for k, a, b in sorted(spans, key=lambda s: -s[1]):  # from the end: earlier token indices stay valid
        m = messages[k]
        if "token_ids" not in m or not m["content"]:
            continue
        # Checked, not decoded: a fast tokenizer's decode drops an unknown id, so the others could still match
        # the text and the id be trained. Such an id means the replies are another model's, all of them.
        if (bad := next((t for t in m["token_ids"] if t >= vocab), None)) is not None:
            raise ForeignIds(f"message {k}: token_ids hold id {bad}, outside the tokenizer's vocabulary of {vocab:,} "
                             f"ids: the replies were generated by another model (regenerate them with this "
                             f"target, or give --tokenizer the model that generated them)")
        notes["token_ids.replies"] += 1
        p = full.find(m["content"], a, b)
        q = p + len(m["content"])
        i0, i1 = bisect.bisect_left(starts, p), bisect.bisect_left(starts, q)
        if p >= 0 and ids[i0:i1] == m["token_ids"]:
            notes["token_ids.same"] += 1
            continue
        aligned = p >= 0 and i0 < i1 and starts[i0] == p and (i0 == 0 or ends[i0 - 1] <= p) and ends[i1 - 1] <= q
        if not aligned or tokenizer.decode(m["token_ids"], skip_special_tokens=False) != m["content"]:
            notes["token_ids.retokenized"] += 1
            continue
        ids = ids[:i0] + list(m["token_ids"]) + ids[i1:]
        mask = np.concatenate([mask[:i0], _ids_mask(tokenizer, m["token_ids"], char_mask[p:q]), mask[i1:]])
        notes["token_ids.spliced"] += 1
    return ids, mask


def _ids_mask(tokenizer, ids: list[int], text_mask: np.ndarray) -> np.ndarray:
    """Each id's mask: `text_mask` (over the characters `ids` decode to) at the id's first character.
    The mask changes at a few characters only (a reasoning block's edges, under --no-reasoning-loss), so
    the first id at or past each change is found by bisection (a few decodes, not one per id)."""
    first_char = lambda j: len(tokenizer.decode(ids[:j], skip_special_tokens=False))  # noqa: E731
    out = np.empty(len(ids), dtype=bool)
    changes = (np.flatnonzero(np.diff(text_mask.astype(np.int8))) + 1).tolist()
    edges = [0] + [bisect.bisect_left(range(len(ids)), c, key=first_char) for c in changes] + [len(ids)]
    for c, j0, j1 in zip([0] + changes, edges, edges[1:]):
        out[j0:j1] = text_mask[c]
    return out


def encode(tokenizer, messages: list[dict], opts: Options, eot: str, notes: Counter | None = None, *,
           tools: list | None = None, turns: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32) and loss mask (uint8) of one render of `messages`, supervising `turns` (default:
    every assistant turn of weight != 0, the last alone under last_turn_only); `notes` counts what was done
    to its replies (cut, target ids spliced or re-tokenized, reasoning left out by the template, reasoning
    tokens supervised)."""
    notes = Counter() if notes is None else notes
    view = template_view(messages)
    render = renderer(tokenizer, opts, tools)
    turns = supervised_turns(messages, opts.last_turn_only) if turns is None else turns
    try:
        full = render(view, False)
        spans = assistant_spans(render, view, full, eot, turns)
    except Skip:
        raise
    except Exception as exc:
        raise template_failure(exc) from exc
    char_mask, reasoning = _char_masks(full, spans, messages, opts, eot, notes)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]
    notes["reasoning_tokens"] += int((char_mask & reasoning)[np.asarray(starts, dtype=np.int64)].sum())
    ids, mask = _splice_target_ids(tokenizer, full, spans, messages, list(enc["input_ids"]), starts,
                                   [e for _, e in enc["offset_mapping"]], char_mask, notes)
    if opts.max_length and len(ids) > opts.max_length:
        raise Skip("over_length", f"{len(ids)} tokens > --max-length {opts.max_length}")
    if not mask.any():
        raise Skip("no_supervised", "no supervised token")
    return np.asarray(ids, dtype=np.uint32), mask.astype(np.uint8)
