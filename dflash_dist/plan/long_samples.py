"""Samples longer than a batch or the target: what a run does with them, checked and counted at its start.

`plan.long_samples=skip` (default): the plan skips a sample longer than `plan.token_budget` (epochs.py,
reason `over_budget`). The share of the dataset's supervised tokens that the plan's skips lose is
weighed at start: over `plan.max_skipped_share` the run refuses (exit 2), any is a WARNING; both name
the `plan.token_budget` that keeps every sample. A sample longer than the target's context
(`max_position_embeddings`) is refused in this mode whatever the budget: the data was prepared for
another target (prepare's `--max-length` cuts it; `truncate` below does too).

`plan.long_samples=truncate`: such a sample keeps its first `limit` tokens, limit = min(plan.token_budget,
max_position_embeddings), with their loss mask; the rest is dropped, counted (samples, tokens,
supervised tokens) in the log and in summary.json's `plan_facts`. The cut is made once, in a view of the
dataset every rank builds alike (`TruncatedDataset`), so the plan, the collation and the packet sizes
all see the same samples, and the plan stays a pure function of (seed, epoch, budgets): a resume rebuilds
the same batches.

Anchors of a cut sample: the rule of `data.anchors` applied to the kept tokens. An anchor p needs its next
token p + 1 kept and supervised; a block "fits" in the sense that every slot it trains lies in the kept
tokens, its slots past the cut carrying no label and no weight, exactly as past a sample's end
(`training.objective.block_labels`). So no label is ever read from a dropped token, the target's context
of every kept position is exactly what the target computes for the uncut sample (causal attention: the
dropped tokens come after), and every kept supervised token is still trained at every slot. Requiring the
whole block (all B - 1 slots) inside the kept tokens was weighed and not taken: it would leave the last
B - 1 kept tokens untrained at slot 1 (where acceptance is decided first) and need the anchor draw to know
each sample's cut; what it would buy is only that the blocks at the cut train all their slots (their
teacher-forced accept length is counted up to the cut, as at any sample's end).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dflash_dist.config import ConfigError
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.plan.epochs import SKIP_REASONS, plan_skips

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TruncatedDataset(TokenDataset):
    """`source` with every sample longer than `limit` cut to its first `limit` tokens (same arrays, same
    digest: the data is unchanged, the cut is the plan's)."""
    limit: int = 0
    source: TokenDataset | None = None
    meta: dict = field(default_factory=dict)  # the source's meta.json, if it has one (preparation's skips)

    @cached_property
    def ends(self) -> np.ndarray:
        return np.minimum(self.offsets[1:], self.offsets[:-1] + self.limit)

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.offsets[:-1]

    @cached_property
    def num_supervised(self) -> np.ndarray:
        """The source's counts less the supervised tokens past each cut (one slice per cut sample)."""
        out = np.array(self.source.num_supervised, dtype=np.int64, copy=True)
        ends = self.ends
        for i in np.flatnonzero(self.offsets[1:] > ends):
            out[i] -= int(np.count_nonzero(self.loss_mask[int(ends[i]):int(self.offsets[i + 1])]))
        return out

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.ends[i])
        return self.tokens[a:b], self.loss_mask[a:b]


def cut_limit(token_budget: int, context: int) -> int:
    """Tokens a truncated sample keeps: a batch holds it, and the target never runs past its positions."""
    return min(token_budget, context)


def run_dataset(ds: TokenDataset, cfg, context: int) -> TokenDataset:
    """The dataset a run trains: `ds` itself, or under plan.long_samples=truncate its cut view when a
    sample is longer than the limit. Every rank calls it alike (a pure function of ds and the config)."""
    limit = cut_limit(cfg.plan.token_budget, context)
    if cfg.plan.long_samples != "truncate" or not len(ds) or int(np.max(ds.lengths)) <= limit:
        return ds
    return TruncatedDataset(ds.tokens, ds.offsets, ds.loss_mask, ds.vocab_size, limit=limit, source=ds,
                            meta=getattr(ds, "meta", None) or {})


def figures(source_lengths, source_supervised, lengths, supervised, skip: dict, *, token_budget: int,
            context: int, limit: int) -> dict:
    """The facts the checks weigh and summary.json records (plain ints and floats), from the source's
    lengths and supervised counts, the ones the plan sees (cut or not) and the plan's skip masks."""
    source_lengths, lengths = np.asarray(source_lengths, np.int64), np.asarray(lengths, np.int64)
    source_supervised, supervised = np.asarray(source_supervised, np.int64), np.asarray(supervised, np.int64)
    total = int(source_supervised.sum())
    skipped = np.logical_or.reduce([skip[k] for k in SKIP_REASONS]) if len(lengths) else np.zeros(0, bool)
    by_length = skip["over_budget"] & (lengths > token_budget)
    lost = int(supervised[skipped].sum())
    cut = source_lengths > lengths
    over_context = source_lengths > context
    return {
        "supervised_tokens": total, "skipped_samples": int(skipped.sum()), "skipped_supervised_tokens": lost,
        "skipped_supervised_share": lost / total if total else 0.0,
        "skipped_by_reason": {k: int(skip[k].sum()) for k in SKIP_REASONS},
        "over_budget_by_length": int(by_length.sum()),
        # The budget under which no sample is skipped for its length: the longest such sample.
        "token_budget_keeping_all": int(lengths[by_length].max()) if by_length.any() else None,
        "token_budget": int(token_budget), "max_position_embeddings": int(context), "truncate_limit": int(limit),
        "over_context_samples": int(over_context.sum()),
        "longest_sample": int(source_lengths.max()) if len(source_lengths) else 0,
        "truncated_samples": int(cut.sum()), "truncated_tokens": int((source_lengths - lengths).sum()),
        "truncated_supervised_tokens": int((source_supervised - supervised).sum()),
    }


def plan_figures(ds: TokenDataset, cfg, context: int) -> dict:
    """`figures` of the dataset a run trains (`run_dataset`'s) under the config's budgets."""
    source = ds.source if isinstance(ds, TruncatedDataset) else ds
    p = cfg.plan
    skip, _ = plan_skips(ds.lengths, ds.num_supervised, p.token_budget, ds.num_anchorable, p.max_anchors,
                         cfg.objective.num_anchors)
    facts = figures(source.lengths, source.num_supervised, ds.lengths, ds.num_supervised, skip,
                    token_budget=p.token_budget, context=context, limit=cut_limit(p.token_budget, context))
    return {"long_samples": p.long_samples, "max_skipped_share": p.max_skipped_share, **facts}


def data_key(cfg) -> str:
    return f"data.path={cfg.data.path}" if cfg.data.path else "data.synthetic.*"


def check_context(facts: dict, cfg, context_from: str) -> None:
    """ConfigError (exit 2) when, under plan.long_samples=skip, a sample is longer than the target's
    context: the data was made for another target, and a plan.token_budget above the context would train
    past the target's positions. `context_from` says where max_position_embeddings was read."""
    n = facts["over_context_samples"]
    if n == 0 or facts["long_samples"] == "truncate":
        return
    ctx = facts["max_position_embeddings"]
    raise ConfigError(
        f"config key '{data_key(cfg)}': {n} sample(s) are longer than the target's context "
        f"(max_position_embeddings {ctx}, {context_from}), the longest {facts['longest_sample']} tokens: the target "
        f"has no positions for their tail; prepare the data with --max-length {ctx} (it leaves them out, counted), or "
        f"set plan.long_samples=truncate (each keeps its first min(plan.token_budget, {ctx}) = "
        f"{facts['truncate_limit']} tokens)")


def _loss_line(f: dict) -> str:
    reasons = ", ".join(f"{k} {n}" for k, n in f["skipped_by_reason"].items() if n)
    return (f"the plan skips {f['skipped_supervised_share']:.1%} of the supervised tokens "
            f"({f['skipped_supervised_tokens']} of {f['supervised_tokens']}; {f['skipped_samples']} samples: "
            f"{reasons})")


def _fixes(f: dict) -> str:
    """What keeps the skipped samples: the budget that holds the longest, or what else skips them."""
    keep = f["token_budget_keeping_all"]
    out = []
    if keep is not None:
        out.append(f"plan.token_budget={keep} keeps every sample (now {f['token_budget']}; a batch's memory "
                   f"follows it), or plan.long_samples=truncate trains each long sample's first "
                   f"{f['truncate_limit']} tokens")
    if f["skipped_by_reason"]["over_budget"] > f["over_budget_by_length"]:
        out.append(f"{f['skipped_by_reason']['over_budget'] - f['over_budget_by_length']} hold more anchors than "
                   "plan.max_anchors: raise it (or lower objective.num_anchors)")
    if f["skipped_by_reason"]["no_anchor"]:
        out.append("no_anchor samples have no supervised token after their first: check the data's loss mask")
    return "; ".join(out)


def check_skipped_share(facts: dict) -> None:
    """Rank 0, at start: ConfigError (exit 2) when the plan's skips lose more than plan.max_skipped_share of
    the supervised tokens; a WARNING with the same facts when they lose any."""
    if facts["skipped_supervised_tokens"] == 0:
        return
    line, fixes = _loss_line(facts), _fixes(facts)
    if facts["skipped_supervised_share"] > facts["max_skipped_share"]:
        raise ConfigError(f"config key 'plan.max_skipped_share': {line}, more than plan.max_skipped_share="
                          f"{facts['max_skipped_share']:g}: {fixes or 'see the reasons'}; or raise "
                          "plan.max_skipped_share to accept the loss")
    log.warning("%s (plan.max_skipped_share=%g allows it)%s", line, facts["max_skipped_share"],
                f": {fixes}" if fixes else "")


def report_truncation(facts: dict) -> None:
    """Rank 0, at start: what plan.long_samples=truncate drops, in the log (summary.json keeps it too)."""
    if not facts["truncated_samples"]:
        return
    total = facts["supervised_tokens"]
    log.warning("plan.long_samples=truncate: %d samples cut to their first %d tokens (min(plan.token_budget=%d, "
                "the target's max_position_embeddings %d)): %d tokens dropped, %d of them supervised (%.1f%% of "
                "the supervised tokens)", facts["truncated_samples"], facts["truncate_limit"], facts["token_budget"],
                facts["max_position_embeddings"], facts["truncated_tokens"], facts["truncated_supervised_tokens"],
                100 * facts["truncated_supervised_tokens"] / total if total else 0.0)

