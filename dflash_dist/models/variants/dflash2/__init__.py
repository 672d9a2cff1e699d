"""DFlash 2: the grouped convolution around each sublayer and the candidate selector on the final states
(`models/variants/dflash2/modules.py`), the selector's term of the objective (`loss.py`); served by vLLM 0.32's
`qwen3_dflash2.py` under the architecture `DFlash2DraftModel` (its `dflash_config` keys: `config_keys`)."""
from __future__ import annotations

from dataclasses import replace

import torch

from dflash_dist.config import ConfigError
from dflash_dist.models.variants.base import Figures, LossChunk, LossWeights, Variant
from dflash_dist.models.variants.dflash2.forecast import DFlash2Forecast
from dflash_dist.models.variants.dflash2.loss import selector_term
from dflash_dist.models.variants.dflash2.modules import (
    CandidateSelector,
    GroupedConv,
    candidate_logits,
    unary_top_k,
    unary_values,
    walk,
)
from dflash_dist.models.variants.dflash2.options import OLD_KEYS, DFlash2Model, DFlash2Options

# What DFlash 2 adds to the engines' settings (docs/serving.md has the sources).
_VLLM = """
The method stays `dflash`: the architecture `DFlash2DraftModel` selects vLLM's DFlash2 speculator, which
walks the selector's path. It exists in Model Runner V2 only (vLLM >= 0.32, needs Triton, i.e. a GPU
build); do not set `VLLM_USE_V2_MODEL_RUNNER=0`: Model Runner V1 refuses this draft ("DFlash candidate-head
drafts")."""
_SGLANG = """
SGLang builds the convolution and the selector from `dflash_config` under the same DFLASH algorithm
(SGLang PR 35371, on its main branch; verl-SpeCo PR 78 found no tagged release up to 0.5.18 with it)."""


class DFlash2(Variant):
    name = "dflash2"
    forecast = DFlash2Forecast()  # what its modules add to the memory and cost forecasts (forecast.py)
    title = "DFlash 2"
    architecture = "DFlash2DraftModel"
    Model, Options, old_keys = DFlash2Model, DFlash2Options, OLD_KEYS
    # z-lab's `dflash2-config.json`; vLLM's qwen3_dflash2.py reads them.
    config_keys = ("conv_group_size", "conv_kernel_size", "final_logit_softcapping", "output_multiplier",
                   "selector_rank", "selector_top_k")
    # acc and accept_len follow the selector's walk; beside them the unary head's own hits and accepted
    # lengths, the selector term's sum of w * ce (before its weight) and the unary top-K's hits of the gold.
    figures = Figures(scalars=("unary_accept_sum", "selector_loss_sum"), slots=("unary_correct", "topk_hits"))

    def check_config(self, cfg) -> None:
        """The convolution reads rows of one block only (models/variants/dflash2/modules.py grouped_conv); with more taps
        than block_size + 1 the shifted block no longer lines up with it (a RuntimeError in the first
        step; block_size + 1 taps still run, the taps past block_size reading only zeros). Checked here,
        not in `check`: that sees the drafter's options only, and the block size is objective.block_size."""
        k, b = cfg.variant.conv_kernel_size, cfg.objective.block_size
        if k > b + 1:
            raise ConfigError(f"config key 'variant.conv_kernel_size': {k} exceeds objective.block_size + 1 "
                              f"({b} + 1): the convolution's taps read rows of one block only")

    def check(self, d: DFlash2Model, target) -> None:
        if target.hidden_size % d.conv_group_size:
            raise ConfigError(f"config key 'variant.conv_group_size': {d.conv_group_size} does not divide the "
                              f"target's hidden size {target.hidden_size}")
        if d.selector_top_k > target.vocab_size:
            raise ConfigError(f"config key 'variant.selector_top_k': {d.selector_top_k} exceeds the target's "
                              f"vocabulary ({target.vocab_size})")

    def loss_weights(self, objective, options) -> LossWeights:
        """The plain head's terms plus the selector's (alpha, on the same labels: under target_full the
        target's top-1), which trains the selector and, undetached, the backbone on its own."""
        unary = super().loss_weights(objective, options)
        return replace(unary, keys={**unary.keys, "variant.selector_weight": options.selector_weight},
                       where=f"{unary.where} with model.draft.variant=dflash2".strip())

    def sublayer_wrappers(self, spec):
        s = spec.options
        return (GroupedConv(spec.hidden_size, s.conv_kernel_size, s.conv_group_size),
                GroupedConv(spec.hidden_size, s.conv_kernel_size, s.conv_group_size))

    def heads(self, spec):
        s = spec.options
        return {"candidate_selector": CandidateSelector(spec.hidden_size, spec.vocab_size, s.selector_rank,
                                                        s.selector_top_k)}

    def loss_top_k(self, spec) -> int:
        return spec.options.selector_top_k  # the selector's candidates come off the loss's own logits

    def loss_term(self, model, hidden, chunk: LossChunk, loss_sum, metrics, top, options: DFlash2Options):
        """The loss adds alpha x the selector term; acc and acceptance follow the selector's walk, the
        unary head's kept beside them."""
        sel_sum, sm = selector_term(model, hidden, chunk.input_ids, chunk.anchors, chunk.labels, chunk.weights,
                                    top, detach=options.selector_detach, rows=chunk.rows)
        a = options.selector_weight
        sums = {"unary_correct": metrics.correct, "unary_accept_sum": metrics.accept_sum,
                "selector_loss_sum": sm.loss_sum, "topk_hits": sm.topk_hits}
        return loss_sum + a * sel_sum, replace(
            metrics, loss_sum=metrics.loss_sum + a * sm.loss_sum, correct=sm.correct, accept_sum=sm.accept_sum,
            sums=sums)

    def reported_figures(self, s) -> dict:
        """The unary head's acc and accepted length, the top-K's recall of the trained labels and the
        selector term's weighted mean loss (nothing in a step without blocks)."""
        if not s.blocks:
            return {}
        return {"unary_acc": s.slot_ratio("unary_correct"), "unary_accept_len": s.per_block("unary_accept_sum"),
                "topk_recall": s.slot_ratio("topk_hits"), "selector_loss": s.per_weight("selector_loss_sum")}

    def unary_candidates(self, model, hidden: torch.Tensor, rows: int = 8192):
        """(ids (n, K), served unary scores (n, K) float32) of final-normed rows (n, H): the head's top-K,
        its logits scaled and soft-capped (vLLM's `compute_candidates`), differentiable in `hidden`."""
        s, head = model.spec.options, model.lm_head.weight
        h = hidden.to(head.dtype)
        ids = unary_top_k(h, head, s.selector_top_k, rows)
        return ids, unary_values(candidate_logits(h, head, ids, rows), s.output_multiplier, s.final_logit_softcapping)

    @torch.no_grad()
    def block_tokens(self, model, hidden, anchor_ids):
        """The selector's greedy walk over the unary head's top-K candidates."""
        h = hidden[:, 1:]
        N, S, H = h.shape
        ids, unary = model.unary_candidates(h.reshape(N * S, H))
        ids, unary = ids.view(N, S, -1), unary.view(N, S, -1)
        return walk(model.candidate_selector.edge_scores(ids, unary, h, anchor_ids), ids)

    def config_fields(self, spec) -> dict:
        # Every layer attends fully (the project trains no sliding window), as these contract fields say.
        return {"dflash_config": {"block_size": spec.block_size, **{k: getattr(spec.options, k) for k in self.config_keys}},
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": spec.num_layers}

    def card_rows(self, spec):
        o = spec.options
        return [("DFlash 2", f"grouped convolution {o.conv_kernel_size} taps x groups of {o.conv_group_size} "
                             f"channels; selector top-{o.selector_top_k}, rank {o.selector_rank}, "
                             f"output multiplier {o.output_multiplier}, soft cap "
                             f"{o.final_logit_softcapping or 'none'}")]

    def card_notes(self):
        return {"vllm": _VLLM, "sglang": _SGLANG}
