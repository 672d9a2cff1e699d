"""Issue 36, cases 13 and 14, for data.sources: a HumanEval file with no problem or a line that is not
UTF-8 exits 2 naming the file (and line); a ShareGPT record with a system turn after its first human
turn, or nested 100,000 deep, is skipped and counted by reason; never a traceback."""
from __future__ import annotations

import gzip
import json
from collections import Counter

from dflash_dist.data import sources
from dflash_dist.exits import EXIT_BAD_INPUT


def chat(rid, first, middle=None):
    turns = [{"from": "human", "value": first}, {"from": "gpt", "value": "ok"}]
    if middle is not None:
        turns.append(middle)
    turns += [{"from": "human", "value": f"more on {first}"}, {"from": "gpt", "value": "sure"}]
    return {"id": rid, "conversations": turns}


def sharegpt(tmp_path, extra: str = "") -> str:
    """A ShareGPT array of 10 usable conversations, `extra` (raw JSON text) spliced in after the third."""
    recs = [json.dumps(chat(f"c{i}_0", f"question {i}")) for i in range(10)]
    if extra:
        recs.insert(3, extra)
    path = tmp_path / "sharegpt.json"
    path.write_text("[\n" + ",\n".join(recs) + "\n]\n")
    return str(path)


def humaneval(tmp_path, lines: list[bytes]) -> str:
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"".join(lines))
    return str(path)


GOOD = json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    pass\n"}).encode() + b"\n"


def run(tmp_path, sg, he, turns=2):
    return sources.main(["--out", str(tmp_path / "out"), "--train", "4", "--heldout", "2", "--turns", str(turns),
                         "--sharegpt", sg, "--humaneval", he])


def test_an_empty_humaneval_exits_2_naming_the_file(tmp_path, caplog):
    he = humaneval(tmp_path, [])
    assert run(tmp_path, sharegpt(tmp_path), he) == EXIT_BAD_INPUT
    assert f"{he}: no HumanEval problem" in caplog.text
    assert not (tmp_path / "out").exists()


def test_a_non_utf8_humaneval_line_exits_2_naming_the_file_and_line(tmp_path, caplog):
    he = humaneval(tmp_path, [GOOD, b'{"task_id": "HumanEval/1", "prompt": "caf\xe9"}\n', GOOD])
    assert run(tmp_path, sharegpt(tmp_path), he) == EXIT_BAD_INPUT
    assert f"{he}:2: not UTF-8" in caplog.text


def test_a_system_turn_after_the_first_human_turn_is_skipped_and_counted(tmp_path):
    bad = json.dumps(chat("sys_0", "hello", middle={"from": "system", "value": "be terse"}))
    assert run(tmp_path, sharegpt(tmp_path, bad), humaneval(tmp_path, [GOOD])) == 0
    meta = json.loads((tmp_path / "out" / "sources.json").read_text())
    assert meta["skipped"] == {"system_not_first": 1} and meta["counts"]["sharegpt_usable"] == 10
    assert "system" not in (tmp_path / "out" / "train.jsonl").read_text()


def test_a_record_nested_100000_deep_is_skipped_and_counted_and_the_next_ones_read(tmp_path):
    deep = '{"id": "deep_0", "conversations": [{"from": "human", "value": ' + "[" * 100_000 + '"x]{"' \
           + "]" * 100_000 + "}]}"
    assert run(tmp_path, sharegpt(tmp_path, deep), humaneval(tmp_path, [GOOD])) == 0
    meta = json.loads((tmp_path / "out" / "sources.json").read_text())
    assert meta["skipped"] == {"nested_too_deep": 1} and meta["counts"]["sharegpt_usable"] == 10


def test_a_deep_record_the_file_ends_inside_is_the_cut_one(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text("[" + json.dumps(chat("a_0", "q")) + ", [" + "[" * 5000)
    skips = Counter()
    assert [i for i, _ in sources.json_array_records(path.read_text(), str(path), skips)] == [0]
    assert skips == {"cut_off_at_end": 1}
