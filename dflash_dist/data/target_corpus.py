"""The default job's token corpus, answered by the target itself (token ids, no chat template).

`python -m dflash_dist.data.regenerate --out DIR [--config FILE]` lands here (the chat JSONL path,
`--input`, is dflash_dist.data.regen): every sample's response is replaced with the target's own greedy
continuation of its prompt.

A drafter is judged by how often it agrees with the target, so it should train on what the target
would say, not on the corpus text: the prompt (the unsupervised prefix) is kept, the response (from the
first supervised token on) is regenerated greedily, with the same length (or cut at `max_new_tokens`,
or after an end-of-sequence token), and is wholly supervised.

Generation is batched without padding (`dflash_dist.models.decode.greedy`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dflash_dist.data.dataset import TokenDataset
from dflash_dist.io.files import atomic_write
from dflash_dist.models.decode import greedy, one_cpu_thread

log = logging.getLogger(__name__)


def split_samples(ds: TokenDataset) -> tuple[np.ndarray, np.ndarray]:
    """(prompt length, response length) per sample: the prompt ends at the first supervised token."""
    lengths = ds.lengths
    plen = lengths.copy()
    sup = np.flatnonzero(ds.loss_mask)
    owner = np.searchsorted(ds.offsets, sup, side="right") - 1  # sample of every supervised token
    samples, first = np.unique(owner, return_index=True)  # sorted tokens: first hit = earliest
    plen[samples] = sup[first] - ds.offsets[samples]
    return plen, lengths - plen


def regenerate_responses(target, ds: TokenDataset, max_new_tokens: int | None = None, batch_size: int = 512,
                         eos_token_id: int | None = None) -> TokenDataset:
    """A new dataset: same prompts, responses replaced by the target's greedy continuation.
    Samples without a supervised token, or without a prompt to continue, are kept as they are."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    plen, rlen = split_samples(ds)
    if max_new_tokens is not None:
        rlen = np.minimum(rlen, max_new_tokens)
    todo = np.flatnonzero((plen > 0) & (rlen > 0))
    no_prompt = int(np.sum((plen == 0) & (rlen > 0)))
    interleaved = int(np.sum(ds.num_supervised[todo] != ds.lengths[todo] - plen[todo]))
    if no_prompt:
        log.warning("%d samples are supervised from their first token: no prompt to continue, kept as they are",
                    no_prompt)
    if interleaved:
        log.warning("%d samples have unsupervised tokens after their first supervised one: everything from "
                    "the first supervised token on is regenerated", interleaved)
    dev = target.embed_tokens.weight.device
    order = todo[np.argsort(-rlen[todo], kind="stable")]  # similar response lengths share a batch
    responses: dict[int, np.ndarray] = {}
    with one_cpu_thread(dev):
        for k in range(0, len(order), batch_size):
            chunk = order[k:k + batch_size]
            prompts = [torch.from_numpy(ds.sample(i)[0][:plen[i]].astype(np.int64)).to(dev) for i in chunk]
            for i, r in zip(chunk, greedy(target, prompts, [int(rlen[i]) for i in chunk])):
                r = r.cpu().numpy()
                if eos_token_id is not None and (hit := np.flatnonzero(r == eos_token_id)).size:
                    r = r[:hit[0] + 1]
                responses[int(i)] = r
    tokens, masks = [], []
    for i in range(len(ds)):
        tok, mask = ds.sample(i)
        if i in responses:
            tok = np.concatenate([tok[:plen[i]], responses[i].astype(tok.dtype)])
            mask = np.concatenate([np.zeros(plen[i], np.uint8), np.ones(len(responses[i]), np.uint8)])
        tokens.append(tok)
        masks.append(np.asarray(mask, dtype=np.uint8))
    offsets = np.zeros(len(ds) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    all_tokens = np.concatenate(tokens) if tokens else ds.tokens[:0]
    vocab = ds.vocab_size if all_tokens.size == 0 or int(all_tokens.max()) < ds.vocab_size else target.vocab_size
    log.info("regenerated %d of %d samples", len(responses), len(ds))
    return TokenDataset(tokens=all_tokens, offsets=offsets, loss_mask=np.concatenate(masks) if masks else
                        ds.loss_mask[:0], vocab_size=vocab)


def regeneration_key(cfg, device: torch.device, max_new_tokens: int | None = None,
                     eos_token_id: int | None = None) -> dict:
    """What the regenerated corpus depends on: the target (config, or the weight files of a local
    model), its compute dtype, the corpus settings and the generation limits."""
    from dflash_dist.models.build import compute_dtype
    tc = cfg.model.target
    key = {"format": 1, "target": dataclasses.asdict(tc), "data": dataclasses.asdict(cfg.data),
           "dtype": str(compute_dtype(tc.dtype, device)), "max_new_tokens": max_new_tokens, "eos": eos_token_id}
    if tc.kind == "hf":
        files = sorted(p for p in Path(tc.path).iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
        key["weights"] = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return key


def cached_regenerate(cache_dir: str | Path, key_dict: dict, fn: Callable[[], TokenDataset]) -> TokenDataset:
    """fn() once per key: the result is kept in cache_dir as regen-<hash>.npz (written atomically, so
    ranks racing on the same key leave one whole file). A cache file that cannot be read whole (truncated
    by a full disk or a copy, damaged: its members carry CRCs) is named in a warning and made again."""
    text = json.dumps(key_dict, sort_keys=True, default=str)
    path = Path(cache_dir) / f"regen-{hashlib.sha256(text.encode()).hexdigest()[:20]}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["key"]) == text:
                    ds = TokenDataset(tokens=z["tokens"], offsets=z["offsets"], loss_mask=z["loss_mask"],
                                      vocab_size=int(z["vocab_size"]))
                    log.info("regenerated corpus: cache hit %s", path)
                    return ds
            log.warning("cache file %s holds another key: regenerating", path)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("cache file %s is damaged (%s: %s): regenerating it", path, type(exc).__name__, exc)
    ds = fn()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: np.savez(f, tokens=ds.tokens, offsets=ds.offsets, loss_mask=ds.loss_mask,
                                          vocab_size=np.int64(ds.vocab_size), key=np.array(text)))
    log.info("regenerated corpus: cached in %s", path)
    return ds


def main(argv=None) -> int:
    """python -m dflash_dist.data.regenerate --out DIR [--config FILE] [key=value ...]: regenerate the
    run's corpus (data.path, or the synthetic default) with its target and write it as a prepared
    dataset; train on it with data.path=DIR."""
    import argparse

    from dflash_dist.config import ConfigError, load_config
    from dflash_dist.data.disk import REQUIRED_META, DatasetError, open_dataset, write_dataset
    from dflash_dist.data.synthetic import synthetic_dataset
    from dflash_dist.models.build import build_target

    ap = argparse.ArgumentParser(prog="dflash_dist.data.regenerate", description=main.__doc__)
    ap.add_argument("--out", required=True, help="output dataset directory")
    ap.add_argument("--config", help="YAML config of the run (it fixes the target and the corpus)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap on every response's length")
    ap.add_argument("--eos-token-id", type=int, default=None, help="a response ends after this token")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        ds = open_dataset(cfg.data.path) if cfg.data.path else synthetic_dataset(cfg.data.synthetic,
                                                                                 cfg.model.target.vocab_size)
        target = build_target(cfg, device)
        new = regenerate_responses(target, ds, args.max_new_tokens, args.batch_size, args.eos_token_id)
        source_meta = {k: v for k, v in (getattr(ds, "meta", None) or {}).items() if k not in REQUIRED_META}
        meta = {**source_meta, "regenerated_from": cfg.data.path or "synthetic",
                "regenerated_by": regeneration_key(cfg, device, args.max_new_tokens, args.eos_token_id)}
        out = write_dataset(args.out, new, meta=json.loads(json.dumps(meta, default=str)), overwrite=args.overwrite)
    except (ConfigError, DatasetError, ValueError, FileNotFoundError, FileExistsError) as exc:
        log.error("%s", exc)
        return 2
    log.info("wrote %s: %d samples, %d tokens", out, len(new), int(new.offsets[-1]))
    return 0
