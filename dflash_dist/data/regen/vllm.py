"""The vLLM engine: one LLM per rank (its own GPU, or `tensor_parallel` GPUs of its node), fed token ids.

Why not vLLM's torchrun mode (distributed_executor_backend="external_launcher"): it makes the whole
torchrun world one engine of TP x PP x DP ranks, and with DP > 1 every engine step all-reduces across the
DP ranks (LLMEngine.has_unfinished_requests_dp), so the ranks run in lockstep: each must call generate()
as often as the others and waits for the slowest batch. Turn-by-turn batches differ from shard to shard,
so that would idle or hang ranks. Here each rank builds its own engine (in-process, uni executor; vLLM's
mp executor across its `tensor_parallel` GPUs): ranks never talk to each other, a slow or failed rank
stalls no one, and every chunk is finished by the rank that owns it.
"""
from __future__ import annotations

import logging
import os

from dflash_dist.data.regen import reaper
from dflash_dist.data.regen.engine import EngineSpec, Generated, OnReply, Request, Sampling, finish

log = logging.getLogger(__name__)


def _pin_devices(local_rank: int, tp: int) -> None:
    """Rank l of a node uses GPUs [l*tp, (l+1)*tp): vLLM numbers the devices it sees from 0. Must run
    before CUDA is initialised in this process; a launcher that set CUDA_VISIBLE_DEVICES wins."""
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch
        if torch.cuda.device_count() > 1 or tp > 1:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(local_rank * tp + i) for i in range(tp))


def _llm_kwargs(spec: EngineSpec, on_cpu: bool) -> dict:
    kw = dict(model=spec.target, tokenizer=spec.tokenizer, seed=0, tensor_parallel_size=spec.tensor_parallel)
    if spec.max_model_len:
        kw["max_model_len"] = spec.max_model_len
    if on_cpu:
        # vLLM's CPU backend reserves 90% of host memory for its KV cache unless told otherwise.
        kw.update(dtype="float32" if spec.dtype == "auto" else spec.dtype,
                  kv_cache_memory_bytes=int(spec.kv_cache_gib * (1 << 30)))
    else:
        kw.update(dtype=spec.dtype, gpu_memory_utilization=spec.gpu_memory_utilization)
    if spec.max_num_seqs:
        kw["max_num_seqs"] = spec.max_num_seqs
    if spec.tensor_parallel > 1:
        kw["distributed_executor_backend"] = "mp"
    return kw


class VllmEngine:
    def __init__(self, spec: EngineSpec, stop_ids: list[int], local_rank: int = 0):
        # vLLM's engine core runs in a child process (its default): on CPU that was 13x the tokens/s of
        # the in-process core (VLLM_ENABLE_V1_MULTIPROCESSING=0) here. The child handles SIGTERM/SIGINT by
        # shutting down, so a signal sent to the whole process group (Ctrl-C) costs the chunk in hand;
        # one sent to this process (torchrun, Slurm through slurm/regenerate.sbatch, kill PID) does not.
        _pin_devices(local_rank, spec.tensor_parallel)
        import torch
        from vllm import LLM
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            from dflash_dist.data.regen.vllm_cpu import note_cpu_binding
            note_cpu_binding()  # how vLLM binds its threads on a small machine (vllm_cpu.py)
        self.reaper = reaper.start()  # its processes die with this one, however it ends (reaper.py)
        self.llm = LLM(**_llm_kwargs(spec, on_cpu))
        self.stop_ids = frozenset(stop_ids)
        self.context_len = int(self.llm.llm_engine.model_config.max_model_len)
        log.info("vllm engine: %s, %s, context %d", spec.target, "cpu" if on_cpu else "cuda", self.context_len)

    def _params(self, sampling: Sampling, max_tokens: int, seed: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        greedy = sampling.temperature == 0
        return SamplingParams(max_tokens=max_tokens, temperature=sampling.temperature,
                              top_p=1.0 if greedy else sampling.top_p, seed=None if greedy else seed,
                              stop_token_ids=sorted(self.stop_ids), detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def generate(self, prompts: list[list[int]], max_tokens: list[int], sampling: Sampling,
                 seeds: list[int]) -> list[Generated]:
        from vllm.inputs import TokensPrompt
        params = [self._params(sampling, m, s) for m, s in zip(max_tokens, seeds)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [finish(list(o.outputs[0].token_ids), m, self.stop_ids) for o, m in zip(outs, max_tokens)]

    def serve(self, requests: list[Request], sampling: Sampling, on_reply: OnReply) -> None:
        """Continuous: a conversation's next turn enters the running batch as soon as its reply ends, so
        batches stay full (one generate() per turn ends each turn on the few longest replies)."""
        from vllm.inputs import TokensPrompt
        engine, live, serial = self.llm.llm_engine, {}, 0

        def add(r: Request) -> None:
            nonlocal serial
            serial += 1
            live[str(serial)] = r
            engine.add_request(str(serial), TokensPrompt(prompt_token_ids=r.prompt),
                               self._params(sampling, r.max_tokens, r.seed))

        for r in requests:
            add(r)
        while live:
            for out in engine.step():
                if out.finished:
                    r = live.pop(out.request_id)
                    nxt = on_reply(r, finish(list(out.outputs[0].token_ids), r.max_tokens, self.stop_ids))
                    if nxt is not None:
                        add(nxt)
