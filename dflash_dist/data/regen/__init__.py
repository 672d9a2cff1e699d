"""Chat regeneration at scale: the target rewrites every assistant turn of a chat corpus, turn by turn.

    chat.py      parse a JSONL line, render turn k's prompt, write the reply back (same schema)
    engine.py    the engine interface; hf.py (transformers) and vllm.py (vLLM) implement it
    run.py       a rank's chunks, turn by turn, stop signals, rank 0's merge
    chunks.py    chunk files, atomic writes, resume key, merge
    progress.py  per-rank totals and rank 0's progress line
    cli.py       the command line (python -m dflash_dist.data.regenerate --input ...)
"""
