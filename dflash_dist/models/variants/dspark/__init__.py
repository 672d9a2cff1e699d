"""DSpark: the DFlash backbone with "anchor as first" blocks, a low-rank Markov bias on every slot's
logits and a confidence head (`heads.py`), trained by `loss.py`; served by vLLM 0.32's
`qwen3_dspark.py` (`Qwen3DSparkForCausalLM`) and its `DSparkSpeculator` under the architecture
`Qwen3DSparkModel`.

Layout: the block is [anchor, MASK x (B-1)] as DFlash's, but slot k drafts the token at anchor + k + 1,
so a block drafts B tokens (vLLM's `sample_from_anchor`: num_speculative_tokens = block_size). An anchor
still needs a supervised next token (data/anchors.py: the same rule), and a slot after an untrained one
trains nothing (the prefix rule: serving never reaches it past a token the block could not predict).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dflash_dist.config import ConfigError
from dflash_dist.models.variants.base import BlockLayout, LossChunk, LossWeights, Needs, Variant
from dflash_dist.models.variants.dspark.forecast import DSparkForecast
from dflash_dist.models.variants.dspark.heads import ConfidenceHead, MarkovHead, markov_walk
from dflash_dist.models.variants.dspark.loss import dspark_term, slot_metrics
from dflash_dist.models.variants.dspark.options import OLD_KEYS, DSparkModel, DSparkOptions

# The DSpark paper's position decay exp(-k / 4), where objective.gamma leaves it to the variant.
GAMMA = 4.0

_VLLM = """
The method is `dspark` (vLLM picks it from the architecture `Qwen3DSparkModel`): every slot drafts, so
`num_speculative_tokens` is the block size here, not block size - 1, and vLLM's own default when it is
not given. It runs in Model Runner V2's DSpark speculator (vLLM >= 0.32, a GPU build)."""
_SGLANG = """
SGLang's DFLASH algorithm serves the DFlash backbone only: it would ignore the Markov head and draft from
the wrong slots. Serve this drafter with vLLM."""


class DSpark(Variant):
    name = "dspark"
    forecast = DSparkForecast()  # what its modules add to the memory and cost forecasts (forecast.py)
    title = "DSpark"
    architecture = "Qwen3DSparkModel"
    Model, Options, old_keys = DSparkModel, DSparkOptions, OLD_KEYS
    layout = BlockLayout(anchor_drafts=True, prefix=True)
    needs = Needs(final_hidden=True, head_loss=False)  # its term is the whole loss (loss.py)
    labels = ("data",)  # its loss distils the target's distribution already (check_config says more)
    float32_prefixes = ("confidence_head.",)
    vllm_method = "dspark"
    # config.json's top-level keys (vLLM's Qwen3DSparkModel reads them off the hf config).
    config_keys = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

    def check_config(self, cfg) -> None:
        """DSpark trains on the data's tokens with its own terms and decay (loss.py)."""
        o = cfg.objective
        if o.labels == "target_full":
            # Refused, not mapped: DSpark's loss already is this distillation (the L1 distance to the same
            # softmax(lm_head(last)), weighted by variant.l1_weight), on slot logits that carry its
            # Markov bias, which the plain head's loss that target_full weighs never sees.
            raise ConfigError("config key 'objective.labels': target_full with model.draft.variant=dspark, whose "
                              "loss distils the target's whole distribution already (use objective.labels=data and "
                              "weigh it with variant.l1_weight)")
        if o.labels != "data":
            raise ConfigError(f"config key 'objective.labels': {o.labels!r} with model.draft.variant=dspark, whose "
                              "loss distils the target's whole distribution already (use data)")
        if o.position_weights != "gamma":
            raise ConfigError("config key 'objective.position_weights': dspark weighs its slots by exp(-k/gamma) "
                              "under the prefix rule (use gamma)")

    def check(self, d: DSparkModel, target) -> None:
        if d.markov_head_type != "vanilla":
            raise ConfigError(f"config key 'variant.markov_head_type': {d.markov_head_type!r}: vLLM 0.32's "
                              "Qwen3 DSpark serves the vanilla head only")

    def loss_weights(self, objective, options: DSparkOptions) -> LossWeights:
        """Its three terms' weights; the confidence term's only with the confidence head (without it the
        key weighs nothing)."""
        keys = {"variant.ce_weight": options.ce_weight, "variant.l1_weight": options.l1_weight}
        if options.enable_confidence_head:
            keys["variant.confidence_weight"] = options.confidence_weight
            return LossWeights(keys, where="under model.draft.variant=dspark")
        return LossWeights(keys, where="under model.draft.variant=dspark with variant.enable_confidence_head="
                                       "false (no confidence term)")

    def heads(self, spec):
        s = spec.options
        heads = {"markov_head": MarkovHead(spec.vocab_size, s.markov_rank)}
        if s.enable_confidence_head:
            heads["confidence_head"] = ConfidenceHead(spec.hidden_size, s.markov_rank, s.confidence_head_with_markov)
        return heads

    def gamma(self, objective) -> float:
        return objective.gamma or GAMMA

    def loss_term(self, model, hidden, chunk: LossChunk, loss_sum, metrics, top, options: DSparkOptions):
        """The whole loss (`loss.py`); acc and acceptance count every slot as a draft."""
        loss, pred = dspark_term(model, hidden, chunk, options)
        correct, accept_sum = slot_metrics(pred, chunk.labels)
        return loss, replace(metrics, loss_sum=loss.detach(), correct=correct, accept_sum=accept_sum)

    @torch.no_grad()
    def block_tokens(self, model, hidden, anchor_ids):
        """(N, B): the greedy walk, each slot biased by the token drafted before it."""
        return markov_walk(model, hidden, anchor_ids)

    def config_fields(self, spec) -> dict:
        # vLLM's Qwen3DSparkModel reads its keys at the top level, the DFlash backbone's loader the mask
        # token and layer ids in dflash_config: both are written (dflash_config also holds the DSpark keys,
        # as every variant's, which spec_fields reads back); sample_from_anchor says every slot drafts.
        keys = {k: getattr(spec.options, k) for k in self.config_keys}
        return {"dflash_config": {"block_size": spec.block_size, **keys}, "sample_from_anchor": True,
                "mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids), **keys}

    def card_rows(self, spec):
        o = spec.options
        conf = ("confidence head" + (" on [h; W1[prev]]" if o.confidence_head_with_markov else " on h")
                if o.enable_confidence_head else "no confidence head")
        return [("DSpark", f"anchor as first ({spec.block_size} drafts per block); Markov head rank "
                           f"{o.markov_rank} ({o.markov_head_type}); {conf}")]

    def card_notes(self):
        return {"vllm": _VLLM, "sglang": _SGLANG}
