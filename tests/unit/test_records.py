"""The files chat data comes in (issue 44 case 7): JSONL, parquet, a `datasets` save_to_disk directory and
a directory of JSONL/parquet files are read record by record; a file that is not JSONL is refused before
its first record, saying what it looks like."""
from __future__ import annotations

import gzip
import json
import zipfile

import datasets  # the dev extra's
import pytest

from dflash_dist.data import records
from dflash_dist.data.jsonl import Conversation, read_record

ROWS = [{"messages": [{"role": "user", "content": "add 1 and 2"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
                      {"role": "tool", "content": "3", "tool_call_id": "c1"},
                      {"role": "assistant", "content": "it is 3.", "reasoning_content": "easy"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello."}]},
        {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "because."}]}]


def contents(path) -> list[tuple[str, int, list[str]]]:
    """(file, number, the assistant texts) of every record read from `path`."""
    out = []
    for name, n, raw in records.iter_records(path):
        rec = read_record(raw)
        assert isinstance(rec, Conversation)
        out.append((name, n, [m["content"] for m in rec.messages if m["role"] == "assistant"]))
    return out


ASSISTANT = [["", "it is 3."], ["hello."], ["because."]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_lines_are_numbered_and_given_raw(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(ROWS[0]) + "\n\n{broken\n" + json.dumps(ROWS[1]) + "\n")
    got = list(records.iter_records(src))
    assert [(n, type(raw)) for _, n, raw in got] == [(1, bytes), (2, bytes), (3, bytes), (4, bytes)]
    assert got[3][2] == (json.dumps(ROWS[1]) + "\n").encode()  # a broken line is the reader's skip, not a refusal


def test_a_parquet_file_is_read_row_by_row(tmp_path):
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "c.parquet"))
    got = contents(tmp_path / "c.parquet")
    assert got == [(str(tmp_path / "c.parquet"), n, a) for n, a in zip((1, 2, 3), ASSISTANT)]
    rec = read_record(next(records.iter_records(tmp_path / "c.parquet"))[2])
    assert rec.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert rec.messages[3]["reasoning_content"] == "easy" and not rec.notes  # nulls of absent fields: nothing


def test_a_saved_dataset_directory(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert [a for _, _, a in contents(tmp_path / "one")] == ASSISTANT
    whole = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"test": whole.select([2]), "train": whole.select([0, 1])}).save_to_disk(str(tmp_path / "dd"))
    assert [a for _, _, a in contents(tmp_path / "dd")] == ASSISTANT[:2]  # its train split
    datasets.DatasetDict({"a": whole, "b": whole}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(records.InputError, match=r"ab: a DatasetDict with splits \['a', 'b'\] and no 'train'"):
        list(records.iter_records(tmp_path / "ab"))


def test_a_directory_of_jsonl_and_parquet_files(tmp_path):
    d = tmp_path / "data"
    (d / "part").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", ROWS[:1])
    datasets.Dataset.from_list(ROWS[1:2]).to_parquet(str(d / "part" / "b.parquet"))
    write_jsonl(d / "c.jsonl", ROWS[2:])
    (d / "README.md").write_text("# my data\n")
    (d / ".hidden").mkdir()
    write_jsonl(d / ".hidden" / "x.jsonl", ROWS)
    got = contents(d)
    assert got == [(str(d / "a.jsonl"), 1, ASSISTANT[0]), (str(d / "c.jsonl"), 1, ASSISTANT[2]),
                   (str(d / "part" / "b.parquet"), 1, ASSISTANT[1])]
    (tmp_path / "empty").mkdir()
    with pytest.raises(records.InputError, match="no .jsonl or .parquet file"):
        list(records.iter_records(tmp_path / "empty"))


def _refused(tmp_path):
    """name -> (file bytes, what the refusal says it looks like)."""
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    zipped = tmp_path / "z.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("c.jsonl", json.dumps(ROWS[0]))
    return {"parquet": ((tmp_path / "p.parquet").read_bytes(), "a parquet file"),
            "gzip": (gzip.compress(json.dumps(ROWS[0]).encode()), "a gzip file"),
            "zip": (zipped.read_bytes(), "a zip archive"),
            "pdf": (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", "a PDF document"),
            "nul": (b'{"messages": []}\n\x00\x01\x02', "binary data"),
            "latin1": ('{"messages": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8 text"),
            "array": (json.dumps(ROWS, indent=1).encode(), "a JSON array"),
            "csv": (b"role,content\nuser,hi\n", "text that is not JSON"),
            "utf16": (json.dumps(ROWS[0]).encode("utf-16"), "UTF-16 text")}


def test_a_file_that_is_not_jsonl_is_refused_before_its_first_record(tmp_path):
    for name, (data, looks) in _refused(tmp_path).items():
        src = tmp_path / f"{name}.jsonl"
        src.write_bytes(data)
        with pytest.raises(records.InputError) as info:
            next(records.iter_records(src))
        assert str(info.value).startswith(f"{src}:1: not a JSONL file: it looks like {looks}"), name


def test_a_missing_path_and_blank_leading_lines(tmp_path):
    with pytest.raises(records.InputError, match="no such file or directory"):
        list(records.iter_records(tmp_path / "nope.jsonl"))
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\xef\xbb\xbf\n\n" + json.dumps(ROWS[1]).encode() + b"\n")  # a BOM and blank lines: still JSONL
    assert [n for _, n, _ in records.iter_records(src)] == [1, 2, 3]
