"""Domino: the DFlash backbone with "anchor as first" blocks and a GRU logit correction on every slot after
the first (`head.py`), trained by `loss.py`; served by SGLang's DFLASH algorithm, which reads
it from the DFlash architecture `DFlashDraftModel` with `dflash_config.projector_type: "domino"`
(sglang/srt/speculative/dflash_utils.py, sglang/srt/models/dflash.py, sglang/srt/speculative/domino_utils.py).
vLLM 0.32 has no Domino head: its DFlash model (vllm/model_executor/models/qwen3_dflash.py) reads no
projector_type and its weight loader refuses the export's `prefix_gru.*` tensors (AutoWeightsLoader: "There
is no module or parameter named ..."), so the evaluator refuses `--engine vllm` up front (`vllm_method` None).

Layout and conventions (checked against SpecForge's specforge/modeling/draft/domino.py and SGLang's
domino_utils.py; see head.py for the GRU's): the block is [anchor, MASK x (B-1)] and slot k drafts
the token at anchor + k + 1 (`shift_label: true`), slot 0 from the base logits alone
(`pure_draft_prefix_len: 1`), slot k >= 1 with the GRU state over the anchor and the k tokens after it.
Training labels every slot whose token lies inside the sequence and the loss mask (SpecForge's per-slot
weight mask: no prefix rule), weighted exp(-k/gamma) (gamma 7 unless `objective.gamma` says otherwise).

Drafts per block: B - 1, slots 0..B-2, as SGLang serves it (`domino_greedy_rollout`: num_proposals =
block_size - 1, its verify window is the block) and SpecForge's `_sample_draft_tokens` samples it, so the
project's decoders and its training acceptance measure what the engine commits (at most B tokens a verify
step). The last slot is trained as SpecForge trains it (every slot of the shifted block) and never drafts.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dflash_dist.config import ConfigError
from dflash_dist.models.variants.base import BlockLayout, Figures, LossChunk, Needs, RunProgress, Variant
from dflash_dist.models.variants.domino.forecast import DominoForecast
from dflash_dist.models.variants.domino.head import domino_heads, domino_rollout
from dflash_dist.models.variants.domino.loss import domino_lambda, domino_term
from dflash_dist.models.variants.domino.options import OLD_KEYS, DominoModel, DominoOptions
from dflash_dist.models.variants.dspark.loss import slot_metrics

# The position decay exp(-k / 7) where objective.gamma leaves it to the variant (issue 35's default).
GAMMA = 7.0
PROJECTOR = "domino"

_VLLM = """
vLLM 0.32 does not serve Domino: its DFlash model (`qwen3_dflash.py`) has no GRU head and its weight loader
refuses this export's `prefix_gru.*` and `embed_proj.*` tensors ("There is no module or parameter named
..."); `dflash_dist.evaluate --engine vllm` refuses it up front (exit 2). Serve it with SGLang."""
_SGLANG = """
SGLang's DFLASH algorithm reads `dflash_config.projector_type: "domino"` and runs the GRU head
(`domino_greedy_rollout`, CUDA only). It proposes block size - 1 tokens per step (its verify window is the
block), the first of this drafter's B drafts; by default it scores a 2,048-token candidate pool of the
base logits (`--speculative-domino-candidate-pool-size`, 0: the whole vocabulary, the drafts this
project's decoders make)."""


def served_metrics(pred: torch.Tensor, labels: torch.Tensor):
    """(correct (B,) at every trained slot, accept_sum of the served drafts): the accepted run counts
    slots 0..B-2 only, the B - 1 that SGLang proposes (the last slot is trained, never drafted)."""
    correct, _ = slot_metrics(pred, labels)
    return correct, slot_metrics(pred[:, :-1], labels[:, :-1])[1]


class Domino(Variant):
    name = "domino"
    forecast = DominoForecast()  # what its modules add to the memory and cost forecasts (forecast.py)
    title = "Domino"
    architecture = "DFlashDraftModel"  # SGLang's DFlash model class; the projector type tells Domino apart
    projector_type = PROJECTOR
    Model, Options, old_keys = DominoModel, DominoOptions, OLD_KEYS
    layout = BlockLayout(anchor_drafts=True)
    needs = Needs(head_loss=False)  # its term is the whole loss (loss.py)
    labels = ("data", "target_full")  # target_full: its two terms distil the target's distribution (loss.py)
    # acc and accept_len follow the final logits' drafts; beside them the base logits' (the plain head's)
    figures = Figures(scalars=("unary_accept_sum",), slots=("unary_correct",))
    vllm_method = None  # vLLM 0.32 cannot serve it

    def check_config(self, cfg) -> None:
        """Its loss is the cross-entropy of its own final and base logits on the data's tokens, or under
        target_full their distillation of the target's whole distribution, weighed by exp(-k/gamma) in its
        anchor-as-first layout (loss.py): the target's argmax or top-k labels and D-PACE's weights
        would be silently ignored, so they are refused."""
        o = cfg.objective
        if o.labels not in ("data", "target_full"):
            raise ConfigError(f"config key 'objective.labels': {o.labels!r} with model.draft.variant=domino, whose "
                              "loss is the cross-entropy on the data's tokens or the distillation of the target's "
                              "whole distribution (use data or target_full)")
        if o.position_weights != "gamma":
            raise ConfigError("config key 'objective.position_weights': domino weighs its slots by exp(-k/gamma) "
                              "(use gamma)")

    def heads(self, spec):
        s = spec.options
        return domino_heads(spec.hidden_size, s.gru_hidden_dim, s.emb_dim, spec.vocab_size)

    def gamma(self, objective) -> float:
        return objective.gamma or GAMMA

    def drafts(self, block_size: int) -> int:
        return block_size - 1  # SGLang's proposals: the block is its verify window

    def loss_term(self, model, hidden, chunk: LossChunk, loss_sum, metrics, top, options: DominoOptions):
        """The whole loss (`loss.py`) at this step's lambda: the two cross-entropies, or under
        target_full (`chunk.full`) the two distillations of the target's distribution; acc follows the
        final logits (what decoding drafts) at every trained slot against the data's tokens or the
        target's top-1, acceptance the served drafts' (slots 0..B-2); the base logits' (the plain LM
        head's, what lambda weighs) figures come beside them as the unary head's."""
        lam = domino_lambda(chunk.progress.step, chunk.progress.total, options.lambda_fraction)
        loss, pred, base, counted = domino_term(model, hidden, chunk, lam)
        correct, accept_sum = served_metrics(pred, counted)
        base_correct, base_accept_sum = served_metrics(base, counted)
        return loss, replace(metrics, loss_sum=loss.detach(), correct=correct, accept_sum=accept_sum,
                             sums={"unary_correct": base_correct, "unary_accept_sum": base_accept_sum})

    def reported_figures(self, s) -> dict:
        """The base logits' acc and accepted length (nothing in a step without blocks)."""
        if not s.blocks:
            return {}
        return {"unary_acc": s.slot_ratio("unary_correct"), "unary_accept_len": s.per_block("unary_accept_sum")}

    def step_figures(self, progress: RunProgress, options: DominoOptions) -> dict:
        return {"domino_lambda": domino_lambda(progress.step, progress.total, options.lambda_fraction)}

    @torch.no_grad()
    def block_tokens(self, model, hidden, anchor_ids):
        """(N, B - 1): the greedy rollout, each slot's GRU fed the tokens drafted before it (SGLang's)."""
        return domino_rollout(model, hidden[:, :-1], anchor_ids)[0]

    def config_fields(self, spec) -> dict:
        # SGLang's parse_dflash_draft_config reads these from dflash_config (emb_dim also at the top level,
        # where SpecForge's configs/qwen3-8b-domino.json has it; both are written and must agree).
        return {"dflash_config": {"block_size": spec.block_size, "projector_type": PROJECTOR,
                                  "gru_hidden_dim": spec.options.gru_hidden_dim, "emb_dim": spec.options.emb_dim,
                                  "shift_label": True, "pure_draft_prefix_len": 1},
                "emb_dim": spec.options.emb_dim}

    def spec_fields(self, cfg: dict) -> dict:
        dc = cfg["dflash_config"]
        if dc.get("shift_label") is not True or dc.get("pure_draft_prefix_len") != 1:
            raise ValueError(f"a Domino export with shift_label={dc.get('shift_label')!r}, pure_draft_prefix_len="
                             f"{dc.get('pure_draft_prefix_len')!r}: this project decodes shift_label true and "
                             "pure_draft_prefix_len 1 only (SGLang's requirement too)")
        return {"variant": self.name, "options": DominoModel(gru_hidden_dim=int(dc["gru_hidden_dim"]),
                                                             emb_dim=int(dc.get("emb_dim", cfg.get("emb_dim"))))}

    def card_rows(self, spec):
        o = spec.options
        return [("Domino", f"anchor as first ({spec.block_size - 1} drafts per block, as SGLang proposes them; "
                           f"all {spec.block_size} slots trained); GRU over the previous tokens' embeddings, hidden "
                           f"{o.gru_hidden_dim}; logit delta Linear({spec.hidden_size + o.gru_hidden_dim}, "
                           f"{o.emb_dim}) -> SiLU -> Linear({o.emb_dim}, {spec.vocab_size}) on "
                           "slots 1..B-1")]

    def card_notes(self):
        return {"vllm": _VLLM, "sglang": _SGLANG}
