"""What a DFlash-family drafter variant supplies, declared once: the loop, the step, the export and both
decoders call these methods and never branch on a variant's name.

Every variant shares the DFlash backbone (`models/drafter.py`: fused target context, draft layers over
[context | block], the target's frozen LM head) and the unary objective (`training/objective.py`). A
variant adds to it, in one object:
- modules: wrappers around each draft layer's sublayers (`sublayer_wrappers`) and heads on the final
  states (`heads`), under the state-dict names its serving contract reads;
- its loss term and metrics (`loss_term`), given the unary loss of an anchor chunk and the head's top-K
  (`loss_top_k`) that the loss computed on its way; the sums of its own figures (`Figures`), which the
  step carries by name, and what metrics.jsonl reports of them (`reported_figures`);
- its export contract (`config_fields` / `spec_fields`, the model card's lines);
- its greedy decode step (`block_tokens`), which both decoders and the export's parity tests call;
- what its modules add to the memory and cost forecasts (`forecast`: a `VariantForecast` of
  `models/variants/forecast.py`, which says what the forecasts ask).
A new variant is a folder here (`<name>/__init__.py` its Variant, beside its modules, loss term and
forecast terms) plus one line in `models/variants/__init__.py`, or a class registered from outside the
package by DFLASH_VARIANTS=module:Class (the registry's docstring says why an environment variable).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from dflash_dist.config import ConfigError, choices, loss_gamma
from dflash_dist.models.variants.forecast import VariantForecast


def accepted_lengths(hits: torch.Tensor) -> torch.Tensor:
    """The accepted length (A,) float32 of blocks whose drafted slots hit (A, drafts) bool (DFlash: slots
    1..B-1; DSpark: every slot): the consecutive hits from the first drafted slot, plus the bonus token
    (what a verify step commits); a miss, or an untrained slot, ends the run. Every figure of acceptance (training metrics, held-out tau) is this."""
    return torch.cumprod(hits.long(), dim=1).sum(1).float() + 1.0


@dataclass(frozen=True)
class RunProgress:
    """Where a training step stands in its run, for a variant whose loss follows a schedule (Domino's
    lambda): the optimizer steps taken before it (restored on resume) and the run's exact total (0: not
    known, a benchmark's or a test's lone step). A run gives its schedule clock's position and horizon
    (training/state.py ScheduleClock): the steps themselves, unless a resume on another layout re-planned
    the rest of the schedule, where the position is fractional."""
    step: float = 0
    total: int = 0


@dataclass(frozen=True)
class BlockLayout:
    """Where a variant's block drafts: the keywords of `training.objective.block_labels`, which the step
    passes as they are. DFlash (the default): slot 0 holds the anchor and drafts nothing, slot k drafts
    anchor + k (B - 1 drafts). `anchor_drafts` (anchor as first: DSpark, Domino): slot k drafts
    anchor + k + 1, every slot a draft (B). `prefix`: a slot after an untrained one (past the sequence or
    the loss mask) trains neither (DSpark)."""
    anchor_drafts: bool = False
    prefix: bool = False


@dataclass(frozen=True)
class Needs:
    """What a variant needs of the target and of the step: `final_hidden`, the target's final-normed last
    hidden state as one more H-wide block of each token's features (DSpark's teacher; the transport and
    the capture read it); `head_loss`, the plain LM head's loss over each anchor chunk, whose metrics and
    top-K its `loss_term` gets to add to (False: its term is the whole loss, DSpark's and Domino's, and the
    step skips that pass). (The run's progress, `RunProgress`, reaches every loss term.)"""
    final_hidden: bool = False
    head_loss: bool = True


@dataclass(frozen=True)
class Figures:
    """The sums of a variant's own figures that its `loss_term` returns in `StepMetrics.sums` by these
    names: `scalars` (a float or a () tensor each) and `slots` (a (B,) vector per block slot each). The
    step sums them over anchor chunks, the drafters' all-reduce over batches and drafters (packed after
    the fixed fields, in this order), and the variant's `reported_figures` turns the step's totals into
    metrics.jsonl's names. None declared (DFlash, DSpark): nothing beyond the fixed fields is carried."""
    scalars: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return self.scalars + self.slots


@dataclass(frozen=True)
class LossChunk:
    """One anchor chunk of a batch as a variant's loss term sees it: the packed batch's token ids, the
    chunk's anchors (packed indices), its labels and position weights (A, B), the LM head's row chunk,
    the batch's target features (packed rows; DSpark reads the final hidden state it asked for), where
    the run stands, and target_full's teacher for a term that computes it."""
    input_ids: torch.Tensor
    anchors: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    rows: int
    features: torch.Tensor | None = None
    progress: RunProgress = RunProgress()
    # objective.labels=target_full: the chunk's `training.objective.FullTarget` (the target's final states
    # and each slot's position), for a term that is the whole loss and declares target_full among its
    # `Variant.labels` (Domino); None otherwise.
    full: Any = None


@dataclass(frozen=True)
class LossWeights:
    """The terms of a variant's loss as the config weighs them: each weighing key's name -> its value,
    whether a term that no key weighs (the plain cross-entropy, weight 1) is there, and the setting that
    makes these the terms ("under objective.labels=target_full"), for the refusal's message."""
    keys: dict[str, float]
    unweighted: bool = False
    where: str = ""

    def trains(self) -> bool:
        return self.unweighted or any(v > 0 for v in self.keys.values())


@dataclass(frozen=True)
class NoOptions:
    """The options of a variant without any of its own (DFlash): its `variant` section is empty."""


def check_trains(variant: "Variant", objective, options) -> None:
    """The one rule on every variant's loss weights: a ConfigError naming the keys when all of them are
    0 and no unweighted term is left (loss 0 and no gradient at every step: a run would end "done",
    its checkpoints and export untrained)."""
    w = variant.loss_weights(objective, options)
    if w.trains():
        return
    names = [f"'{k}'" for k in w.keys]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    raise ConfigError(f"config keys {listed}: at least one must be > 0 {w.where} "
                      f"({'both are' if len(names) == 2 else 'all are'} 0: nothing would be trained)")


class Variant:
    """The plain DFlash drafter: no module, term or contract field beyond the backbone's. Subclasses
    override what they add; each method's default is DFlash's behaviour."""
    name = "dflash"
    title = "DFlash"  # the model card's heading
    architecture = "DFlashDraftModel"  # config.json's `architectures`: the engines pick their model class by it
    # dflash_config.projector_type: what tells variants of one architecture apart (Domino's "domino"; None: absent)
    projector_type: str | None = None
    # Its options, the config's `variant` section (config keys `variant.<name>`): `Options`, a frozen
    # dataclass of typed fields declared with config.num / one_of (checked as the schema's keys are), holds
    # them all; `Model`, the part that fixes the drafter (its shapes and heads), is what DraftSpec.options
    # carries and the export writes. Options subclasses Model, so one section lists both.
    Model: type = NoOptions
    Options: type = NoOptions
    # The keys its options had before the `variant` section -> the option's name: still taken, mapped.
    old_keys: dict[str, str] = {}
    config_keys: tuple[str, ...] = ()  # its Model's fields as config.json's dflash_config names them
    layout = BlockLayout()  # its block layout, which the step's labels read (DFlash's: the default)
    # What it needs of the target and the step (DFlash: the plain head's loss, nothing beyond the features).
    needs = Needs()
    # The objective.labels values it trains on, which the registry's rule checks (after `check_config`'s
    # own). The plain head's loss takes all four; a variant whose term is the whole loss
    # (`Needs.head_loss` False) declares those its term handles (target_full: against `LossChunk.full`).
    labels: tuple[str, ...] = choices()["objective.labels"]
    figures = Figures()  # the sums of its own figures that its loss term returns (DFlash: none)
    # State-dict prefixes exported in float32 whatever the export's dtype (the engine's params are).
    float32_prefixes: tuple[str, ...] = ()
    vllm_method: str | None = "dflash"  # vLLM's speculative method for this architecture (None: vLLM cannot serve it)
    # What its own modules add to the memory and cost forecasts: a `VariantForecast` (forecast.py here)
    # answering its five questions; the default is DFlash's, nothing beyond the backbone. A variant with
    # modules of its own declares its subclass here (the built-ins' live in their folders,
    # `<name>/forecast.py`): the one place the forecasts ask (`dflash_dist.forecast.variants.forecast_of`).
    forecast: VariantForecast = VariantForecast()

    # The declared layout by the name earlier issues gave it (the decoders and forecasts read it).
    @property
    def anchor_drafts(self) -> bool:
        return self.layout.anchor_drafts

    # -- build ---------------------------------------------------------------------------------------
    def model_options(self, options):
        """DraftSpec.options from an options value: its `Model`'s fields taken from `options` where it has
        them (its `Options` has them all), each other field its default (another variant's value)."""
        return self.Model(**{f.name: getattr(options, f.name) for f in fields(self.Model) if hasattr(options, f.name)})

    def check_config(self, cfg) -> None:
        """Raise a ConfigError naming the key when the loaded config (`config.Config`) asks this variant
        for what it cannot train: run by `config.validate` (the registry adds it), before any group forms."""

    def check(self, options, target) -> None:
        """Raise a ConfigError naming the key when its `Model` options do not fit the target's shapes."""

    def sublayer_wrappers(self, spec) -> tuple[nn.Module | None, nn.Module | None]:
        """(around the attention, around the MLP) of one draft layer; None: the sublayer as it is. A
        wrapper has `prepare(h) -> (input, state)` and `finish(output, state) -> output`, which the
        backbone calls around the sublayer (`models.drafter.wrapped`)."""
        return None, None

    def heads(self, spec) -> dict[str, nn.Module]:
        """Modules on the final states, by their state-dict name."""
        return {}

    # -- training -----------------------------------------------------------------------------------
    def loss_weights(self, objective, options) -> LossWeights:
        """The keys that weigh this variant's loss under `objective` (cfg.objective) and its `options`
        (its Options value), which `check_trains` refuses when none trains anything. The plain head's loss:
        its cross-entropy (no key), or under target_full the KL and L1 distillation's two weights."""
        if objective.labels == "target_full":
            return LossWeights({"objective.distill_kl_weight": objective.distill_kl_weight,
                                "objective.distill_l1_weight": objective.distill_l1_weight},
                               where="under objective.labels=target_full")
        return LossWeights({}, unweighted=True)

    def drafts(self, block_size: int) -> int:
        """Tokens drafted per block: those after the anchor's slot, or every slot's (anchor as first)."""
        return block_size if self.anchor_drafts else block_size - 1

    def gamma(self, objective) -> float:
        """The position decay's gamma (`objective.gamma`, 0: the paper's rule for the block size)."""
        return loss_gamma(objective)

    def loss_top_k(self, spec) -> int:
        """Top-K candidates per labelled row that `loss_term` needs from the LM head's loss (0: none)."""
        return 0

    def loss_term(self, model, hidden: torch.Tensor, chunk: LossChunk, loss_sum: torch.Tensor, metrics,
                  top, options):
        """(loss_sum, metrics) of an anchor chunk with this variant's term added: `loss_sum` and `metrics`
        are the unary loss's (`lm_head_loss`), `top` its `HeadTopK` (with `loss_top_k` > 0), `options`
        its Options value (the run's: frozen). The metrics' `sums` hold every name its `figures` declares."""
        return loss_sum, metrics

    def reported_figures(self, stats) -> dict:
        """metrics.jsonl's figures of this variant's step from the step's totals over the drafters
        (`training.stats.StepStats`: its fixed fields, `sums` by the declared names and the ratios
        `slot_ratio`, `per_block`, `per_weight`); {} where it declares none."""
        return {}

    def step_figures(self, progress: RunProgress, options) -> dict:
        """This variant's own figures of the training step at `progress` (its schedule's values: Domino's
        lambda), added to metrics.jsonl's step record."""
        return {}

    # -- decoding -----------------------------------------------------------------------------------
    @torch.no_grad()
    def block_tokens(self, model, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The drafted tokens (N, B-1) of blocks' final-normed states (N, B, H) at temperature 0."""
        head = model.lm_head
        return head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)

    # -- export -------------------------------------------------------------------------------------
    def config_fields(self, spec) -> dict:
        """config.json's fields beyond the backbone's (`dflash_config` entries under that key)."""
        return {}

    def spec_fields(self, cfg: dict) -> dict:
        """DraftSpec fields of this variant read back from an export's config.json: its name and its
        `Model` options."""
        return {"variant": self.name, "options": self.Model(**{k: cfg["dflash_config"][k] for k in self.config_keys})}

    def card_rows(self, spec) -> list[tuple[str, str]]:
        """Rows of the model card's table describing this variant's modules."""
        return []

    def card_notes(self) -> dict[str, str]:
        """What each engine's section of the model card adds for this variant ("vllm", "sglang")."""
        return {}
