"""How fast drafters learn a real target: the target's features captured once, drafters trained on the
very same batches, then acceptance per block position on held-out samples.

    python -m dflash_dist.bench.learning --config configs/smollm2_135m.yaml --data runs/real/prepared \
        model.target.path=runs/real/target [--heldout 40] [--sizes 140,280,560] [--epochs 3] \
        [--variants dflash,dflash+dpace,dflash2,dflash2+dpace] [--eval-anchors 16] [--json OUT] [key=value ...]

The training run's own pieces, in one process and without the transport: the epoch plans (`plan_for_epoch`
under the config's token budget, seeded), the anchors (`draw_anchors`, seeded by epoch and batch),
`drafter_step`, AdamW with the run's warm-up and cosine (`TrainState.create`), gradient clipping. Each
variant of each size starts from the same seeded weights; `--sizes` are the first N training samples
(the learning curve at fixed epochs). The held-out samples are the dataset's last `--heldout`, never
trained on.

tau~ is the teacher-forced acceptance: at each of a fixed set of held-out anchors the block the drafter
drafts (the unary argmax, or DFlash 2's greedy walk over its candidates: what vLLM serves) is compared
with the reply's next tokens, and the accepted prefix + 1 is averaged. On replies the target generated
greedily (regenerated data), that is what a verify step starting at that anchor accepts in greedy
speculative decoding, so it estimates served tau without decoding (the served figure visits the
anchors the accepted prefixes lead to, not uniform ones). Features are cached in data.cache_dir keyed by
the dataset, the target and the layer ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from dflash_dist.bench.jobs import write_json
from dflash_dist.config import ConfigError, load_config, ranged
from dflash_dist.data.collate import collate
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.data.disk import open_dataset
from dflash_dist.io.files import atomic_write, check_output_path
from dflash_dist.models.build import build_drafter, build_target, draft_spec
from dflash_dist.models.drafter import anchor_seq_starts
from dflash_dist.models.variants import RunProgress, variant_of
from dflash_dist.models.variants.base import accepted_lengths
from dflash_dist.parallel.transport import packet_spec, sends_final_hidden
from dflash_dist.plan.epochs import plan_for_epoch
from dflash_dist.training.capture import capture_for_drafter
from dflash_dist.training.objective import anchor_generator, block_labels, draw_anchors
from dflash_dist.training.state import TrainState
from dflash_dist.training.step import StepBatch, drafter_step, step_settings

log = logging.getLogger("dflash_dist.bench.learning")

VARIANTS = {"dflash": [], "dflash+dpace": ["objective.position_weights=dpace"],
            "dflash2": ["model.draft.variant=dflash2"],
            "dflash2+dpace": ["model.draft.variant=dflash2", "objective.position_weights=dpace"],
            "dspark": ["model.draft.variant=dspark"], "domino": ["model.draft.variant=domino"],
            "dflash+full": ["objective.labels=target_full"]}
SHOWN_SLOTS = (1, 2, 3, 4, 8)
RECALL_TOP_K = 16


def subset(ds, lo: int, hi: int) -> TokenDataset:
    """Samples [lo, hi) of a dataset, as a dataset of their own (contiguous in the token array)."""
    a, b = int(ds.offsets[lo]), int(ds.offsets[hi])
    return TokenDataset(np.asarray(ds.tokens[a:b]), np.asarray(ds.offsets[lo:hi + 1]) - a,
                        np.asarray(ds.loss_mask[a:b]), ds.vocab_size)


def feature_key(data: Path, target_cfg, layer_ids, final: bool) -> str:
    """The features' cache key: the dataset's meta, the target's settings and, for a transformers
    target, its config and weight files (name, size, mtime), the layer ids and whether the final
    hidden state follows them."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target_cfg), sort_keys=True).encode())
    h.update((data / "meta.json").read_bytes())
    if target_cfg.kind == "hf":
        root = Path(target_cfg.path)
        h.update((root / "config.json").read_bytes())
        for f in sorted(root.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    h.update(repr(tuple(layer_ids)).encode())
    if final:  # (the key of a cache without it is the one it always had)
        h.update(b"final")
    return h.hexdigest()[:16]


@torch.no_grad()
def capture_all(target, ds, layer_ids, cache: Path, objective, final: bool,
                tokens_per_call: int = 2048) -> list[torch.Tensor]:
    """Per-sample features (len_i, n_layers * H, and H more with `final`: the target's final hidden
    state), bfloat16 (the transfer dtype of a GPU run), cached; by the run's own capture."""
    feats = load_cached(cache, ds.lengths)
    if feats is not None:
        return feats
    feats, t0, i = [], time.time(), 0
    lengths = ds.lengths
    while i < len(ds):
        j, n = i, 0
        while j < len(ds) and (j == i or n + lengths[j] <= tokens_per_call):
            n += int(lengths[j])
            j += 1
        b = collate(ds, np.arange(i, j))
        f, _ = capture_for_drafter(target, b, list(layer_ids), objective, torch.bfloat16, final_features=final)
        feats.extend(f.split(lengths[i:j].tolist()))
        i = j
        log.info("features: %d/%d samples (%.0f s)", i, len(ds), time.time() - t0)
    try:  # atomically: a full disk or a kill leaves no cut file under the final name
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, lambda f: torch.save(feats, f))
    except OSError as exc:  # the features are in memory: the benchmark goes on, uncached
        log.warning("features not cached in %s: %s", cache, exc.strerror or exc)
    return feats


def load_cached(cache: Path, lengths) -> list[torch.Tensor] | None:
    """The cached features, or None (to be captured again) when there are none or the file is damaged:
    cut, not a torch file, or not one tensor per sample of the right length. A cache written before
    writes were atomic may be a full disk's cut file, and loading it would fail every rerun."""
    if not cache.is_file():
        return None
    try:
        feats = torch.load(cache, weights_only=True)
        if isinstance(feats, list) and len(feats) == len(lengths) and all(
                isinstance(f, torch.Tensor) and f.dim() == 2 and f.shape[0] == n for f, n in zip(feats, lengths)):
            return feats
        why = "not one feature tensor per sample of its length"
    except Exception as exc:  # torch.load's errors for a damaged file are of many types (zip, pickle, EOF)
        why = f"{type(exc).__name__}: {exc}"
    log.warning("feature cache %s is damaged (%s): captured again", cache, why)
    return None


def batch_features(feats, base: int, idx: np.ndarray, width: int) -> torch.Tensor:
    """The batch's features, the first `width` columns (a config without the final state leaves it)."""
    return torch.cat([feats[base + int(i)][:, :width] for i in idx]).float()


def feature_width(cfg, spec) -> int:
    """Columns of a config's features: the captured layers', and the final state where it is sent."""
    return packet_spec(cfg, spec, torch.device("cpu")).feat_dim


def train(cfg, target, ds, feats, epochs: int) -> dict:
    """One drafter trained `epochs` epochs on `ds` (features `feats[i]` of its sample i)."""
    spec = draft_spec(cfg, target)
    model = build_drafter(spec, target, cfg.model.draft.seed, torch.device("cpu"))
    o = cfg.objective
    # One batch per optimizer step: the batch's own mean is the step's (objective.loss_norm alike).
    settings = dataclasses.replace(step_settings(cfg, spec), batch_mean=True)
    plans = [plan_for_epoch(ds, cfg, e) for e in range(epochs)]
    total = sum(len(p) for p in plans)
    state = TrainState.create(model, cfg, total)
    width = feature_width(cfg, spec)
    times = []
    for e, plan in enumerate(plans):
        last_loss = last_weight = 0.0  # the epoch's, so the last epoch's mean is reported
        for b in range(len(plan)):
            idx = plan.batch(b)
            batch, f = collate(ds, idx), batch_features(feats, 0, idx, width)
            anchors, cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, o.num_anchors,
                                       anchor_generator(cfg.train.seed, e, b))
            t0 = time.perf_counter()
            # the run's place in its schedule, as the drafter role passes it (Domino's lambda follows it)
            progress = RunProgress(len(times), total)
            m = drafter_step(model, StepBatch(batch, f, None, anchors, cu, progress), settings)
            state.optimizer_step(list(model.parameters()), cfg, float(m.loss_sum))  # the run's, its skip included
            times.append(time.perf_counter() - t0)
            last_loss, last_weight = last_loss + float(m.loss_sum), last_weight + float(m.weight_sum)
        log.info("epoch %d: %d steps, loss %.3f (%.1f s a step)", e, len(plan), last_loss / max(last_weight, 1e-9),
                 float(np.median(times)))
    return dict(model=model, steps=len(times), step_s=float(np.median(times)),
                loss=last_loss / max(last_weight, 1e-9))


@torch.no_grad()
def acceptance(model, ds, feats, base: int, num_anchors: int, seed: int, width: int, seqs: int = 8) -> dict:
    """tau~, accuracy per drafted token along the served path, and the plain head's top-K recall of the
    reply's token, at seeded anchors of the held-out samples. Figures are by the drafted token's distance
    d from the anchor (index d: the token at anchor + d), whichever slot drafts it (DFlash's slot d, an
    anchor-as-first variant's slot d - 1), so the variants' columns compare; index 0 is unused (0)."""
    B, v = model.spec.block_size, model.spec.family
    # the recall's K: a DFlash 2 drafter's candidates, else DFlash 2's default (16), so the columns compare
    D, K = v.drafts(B), getattr(model.spec.options, "selector_top_k", RECALL_TOP_K)
    first = 0 if v.anchor_drafts else 1  # the first drafting slot; slots first .. first + D - 1 draft
    hits, in_top, valid, runs = torch.zeros(D + 1), torch.zeros(D + 1), torch.zeros(D + 1), []
    model.eval()
    for s in range(0, len(ds), seqs):
        idx = np.arange(s, min(s + seqs, len(ds)))
        batch, f = collate(ds, idx), batch_features(feats, base, idx, width)
        anchors, cu = draw_anchors(batch.loss_mask, batch.cu_seqlens, num_anchors, anchor_generator(seed, 0, s))
        # the reply's tokens at anchor + 1 .. anchor + D, -100 past a sequence or the loss mask
        labels, _ = block_labels(batch.input_ids, batch.loss_mask, batch.cu_seqlens, anchors, cu, B, 1.0,
                                 anchor_drafts=v.anchor_drafts)
        hidden = model.draft_hidden(model.context(f), batch.input_ids, batch.position_ids, anchors,
                                    anchor_seq_starts(batch.cu_seqlens, cu, anchors.numel()))
        drafted = model.block_tokens(hidden, batch.input_ids[anchors])  # (A, D): the served path
        served = labels[:, first:first + D]
        ok = served >= 0
        hit = (drafted == served) & ok
        top = model.lm_head(hidden[:, first:first + D].to(model.lm_head.weight.dtype)).topk(K, dim=-1).indices
        in_top[1:] += ((top == served[..., None]).any(-1) & ok).sum(0).float()
        hits[1:] += hit.sum(0).float()
        valid[1:] += ok.sum(0).float()
        runs.append(accepted_lengths(hit))
    model.train()
    acc, recall = (hits / valid.clamp(min=1)).tolist(), (in_top / valid.clamp(min=1)).tolist()
    runs = torch.cat(runs)
    # every block's accepted length, in the anchors' seeded order (the same for every variant): the standard
    # error of tau~ and, paired with another variant's, of their difference
    return dict(tau=float(runs.mean()), tau_se=float(runs.std() / len(runs) ** 0.5), acc=acc, recall_top_k=recall,
                top_k=K, blocks=len(runs), accepted=runs.tolist())


def paired_se(a: list[float], b: list[float]) -> float:
    """The standard error of mean(a) - mean(b) over the same blocks."""
    d = torch.tensor(a) - torch.tensor(b)
    return float(d.std() / len(d) ** 0.5)


def sizes_flag(text: str) -> list[int]:
    """--sizes: comma-separated sample counts, each a whole number >= 1 (argparse's exit 2 otherwise)."""
    one = ranged(int, ge=1)
    return [one(x) for x in text.split(",")]


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_135m.yaml")
    p.add_argument("--data", required=True, help="a prepared dataset (data.prepare) of target-regenerated replies")
    p.add_argument("--heldout", type=ranged(int, ge=1), default=40, help="the dataset's last N samples, never trained on")
    p.add_argument("--sizes", type=sizes_flag, default=None,
                   help="training samples, comma-separated (default: all but the held-out)")
    p.add_argument("--epochs", type=ranged(int, ge=0), default=0, help="0: train.epochs of the config")
    p.add_argument("--variants", default="dflash", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--eval-anchors", type=ranged(int, ge=1), default=16, help="held-out anchors per sample (seeded)")
    p.add_argument("--threads", type=ranged(int, ge=0), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default="")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = p.parse_intermixed_args(argv)  # overrides may come before or after the flags
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {bad} not of {list(VARIANTS)}")
    try:  # before any capture or training: a bad path or key is bad input (exit 2), not a late traceback
        if a.json:
            check_output_path(a.json, "--json", make_parents=True)
        names = a.variants.split(",")
        a.base_cfg = load_config(a.config, own_overrides(p, a.overrides, [], names))
        # every variant's config now, so that a key one of them refuses stops no run half done
        a.cfgs = {v: load_config(a.config, own_overrides(p, a.overrides, VARIANTS[v], names)) for v in names}
        a.ds = open_dataset(Path(a.data))
    except (ValueError, OSError) as exc:  # ConfigError, OutputPathError, DatasetError are ValueErrors
        p.error(str(exc))
    if not a.heldout < len(a.ds):
        p.error(f"--heldout {a.heldout}: the dataset {a.data} has {len(a.ds)} samples")
    pool = len(a.ds) - a.heldout
    a.sizes = a.sizes or [pool]
    if any(n > pool for n in a.sizes):
        p.error(f"--sizes {a.sizes}: each must be in [1, {pool}] (the samples before the held-out {a.heldout})")
    return p, a


def own_overrides(p: argparse.ArgumentParser, overrides: list[str], variant: list[str], names: list[str]) -> list[str]:
    """The overrides one compared variant's config takes: every key but a variant option (`variant.K`) its
    variant lacks, so `variant.markov_rank=16` shapes DSpark and leaves DFlash alone. An option no
    compared variant has is exit 2 naming it."""
    def options(keys: list[str]) -> set[str]:
        name = next((k.split("=", 1)[1] for k in keys if k.startswith("model.draft.variant=")), "dflash")
        return {f.name for f in dataclasses.fields(variant_of(name).Options)}

    own, every = options(variant), set().union(*(options(VARIANTS[n]) for n in names))
    out = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if key.startswith("variant.") and key.removeprefix("variant.") not in every:
            p.error(f"{key}: an option of none of --variants {','.join(names)}")
        if not key.startswith("variant.") or key.removeprefix("variant.") in own:
            out.append(item)
    return [*out, *variant]


def print_table(rows: list[dict], a, data: Path) -> None:
    print(f"\nheld-out tau~ (teacher-forced acceptance, {rows[0]['blocks']} blocks of {a.heldout} samples), {data}:")
    ref = {r["samples"]: r for r in rows if r["variant"] == rows[0]["variant"]}
    head = (f"{'variant':<15}{'samples':>8}{'steps':>7}{'step s':>8}{'x step':>8}{'loss':>8}{'tau~':>8}{'se':>7}"
            f"{'x tau':>7}{'d/se':>7}")
    slots = [k for k in SHOWN_SLOTS if k < len(rows[0]["acc"])]
    K = rows[0]["top_k"]
    print(head + "".join(f"{f'acc@{k}':>8}" for k in slots) + f"{f'top{K}@1':>9}{f'top{K}@4':>9}")
    for r in rows:
        base = ref[r["samples"]]
        print(f"{r['variant']:<15}{r['samples']:>8}{r['steps']:>7}{r['step_s']:>8.2f}{r['step_s'] / base['step_s']:>8.2f}"
              f"{r['loss']:>8.3f}{r['tau']:>8.3f}{r['tau_se']:>7.3f}{r['tau'] / base['tau']:>7.2f}"
              f"{(r['tau'] - base['tau']) / max(paired_se(r['accepted'], base['accepted']), 1e-12):>7.1f}"
              + "".join(f"{r['acc'][k]:>8.3f}" for k in slots)
              + "".join(f"{r['recall_top_k'][k]:>9.3f}" for k in (1, min(4, len(r['acc']) - 1))))


def check_against_target(p: argparse.ArgumentParser, a, target) -> tuple[int, ...]:
    """Every variant's drafter spec built against the target before any capture, by training's own
    checks (`draft_spec`: target_layer_ids within the target, each variant's keys against its shapes,
    such as DFlash 2's conv_group_size and selector_top_k): a key one of them refuses is bad input,
    exit 2 naming it, not a traceback after the features were captured and the first variant trained.
    Returns the layer ids the features are captured at (the base config's)."""
    try:
        for cfg in a.cfgs.values():
            draft_spec(cfg, target)
        return draft_spec(a.base_cfg, target).target_layer_ids
    except ConfigError as exc:
        p.error(str(exc))


def main(argv=None) -> None:
    p, a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    base_cfg, ds, data = a.base_cfg, a.ds, Path(a.data)
    pool = len(ds) - a.heldout
    epochs = a.epochs or base_cfg.train.epochs
    target = build_target(base_cfg, torch.device("cpu"))
    layer_ids = check_against_target(p, a, target)
    # The final hidden state is captured once for all when any variant reads it (DSpark, target_full).
    final = any(sends_final_hidden(c.objective.labels, variant_of(c.model.draft.variant).needs.final_hidden)
                for c in a.cfgs.values())
    key = feature_key(data, base_cfg.model.target, layer_ids, final)
    cache = Path(base_cfg.data.cache_dir) / f"learning-features-{key}.pt"
    feats = capture_all(target, ds, layer_ids, cache, base_cfg.objective, final)
    held = subset(ds, pool, len(ds))
    rows = []
    for n in a.sizes:
        for v in a.variants.split(","):
            r = train(a.cfgs[v], target, subset(ds, 0, n), feats, epochs)
            model = r.pop("model")
            ev = acceptance(model, held, feats, pool, a.eval_anchors, seed=12345,
                            width=feature_width(a.cfgs[v], model.spec))
            rows.append(dict(variant=v, samples=n, epochs=epochs, **r, **ev))
            log.info("%s on %d samples: tau~ %.3f", v, n, ev["tau"])
    print_table(rows, a, data)
    if a.json:
        write_json(a.json, dict(data=str(data), heldout=a.heldout, config=a.config, overrides=a.overrides, rows=rows))

if __name__ == "__main__":
    main()
