"""Training data: token datasets and collation into packed batches (dataset.py, collate.py), the on-disk
format (disk.py) and its digest (digest.py), the synthetic corpus (synthetic.py), chat JSONL preparation
(prepare.py), the default job's token corpus answered by the target (target_corpus.py), and chat
regeneration through vLLM or transformers (regen/). `python -m dflash_dist.data.regenerate` is the entry
point of both regenerations.

May import: models/ (the target that answers), observe/ (progress), runtime/ (regeneration's watchdog),
io/ (atomic writes, the output lock), config.py, exits.py.
"""
