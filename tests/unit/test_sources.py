"""dflash_dist.data.sources: the real recipe's ShareGPT slice and HumanEval prompts."""
import json
from collections import Counter

import pytest
from corpora import corpus

from dflash_dist.data import sources
from dflash_dist.evaluation.prompts import read_prompt_file


def build(tmp_path, **kw):
    sg, he = corpus(tmp_path)
    args = dict(n_train=6, n_heldout=3, turns=1, seed=0, max_chars=2000, sharegpt=sg, humaneval=he)
    args.update(kw)
    return sources.build(tmp_path / "out", **args)


def test_records_before_the_cut_are_read_and_the_cut_one_counted(tmp_path):
    sg, _ = corpus(tmp_path)
    skips = Counter()
    got = list(sources.json_array_records(sg.read_text(), str(sg), skips))
    assert len(got) == 27 and got[-1][1]["id"] == "long_0"
    assert skips == {"cut_off_at_end": 1}


def test_a_malformed_record_inside_the_file_is_an_error_naming_the_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n {"id": "a", "conversations": []},\n {"id": "b" "conversations": []},\n {"id": "c"}\n]')
    with pytest.raises(sources.SourceError, match=r"bad.json:3: record 1 is not valid JSON"):
        list(sources.json_array_records(bad.read_text(), str(bad), Counter()))


def test_every_record_is_used_or_counted(tmp_path):
    meta = build(tmp_path)
    assert meta["skipped"] == {"cut_off_at_end": 1, "not_user_first": 1, "empty_conversation": 1, "turn_too_long": 1}
    assert meta["counts"]["sharegpt_usable"] == 24 and meta["counts"]["sharegpt_ids"] == 12


def test_train_and_heldout_share_no_conversation_and_follow_the_seed(tmp_path):
    build(tmp_path)
    out = tmp_path / "out"
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    heldout = read_prompt_file(out / "heldout.jsonl")
    assert len(train) == 6 and heldout.kind == "turns" and len(heldout.items) == 3

    def conv_of(text):  # "question 3 part two" and "question 3" are one ShareGPT conversation
        return text.split(" part")[0]

    train_convs = {conv_of(c["conversations"][0]["value"]) for c in train}
    assert train_convs.isdisjoint({conv_of(t[0]) for t in heldout.items})
    # --turns 1: one human turn and its reply
    assert all([m["from"] for m in c["conversations"]] == ["human", "gpt"] for c in train)
    again = (out / "train.jsonl").read_text()
    sources.build(out, 6, 3, sharegpt=tmp_path / "sharegpt.json", humaneval=tmp_path / "he.jsonl.gz")
    assert (out / "train.jsonl").read_text() == again
    sources.build(out, 6, 3, seed=1, sharegpt=tmp_path / "sharegpt.json", humaneval=tmp_path / "he.jsonl.gz")
    assert (out / "train.jsonl").read_text() != again


def test_more_turns_keep_more_of_each_conversation(tmp_path):
    build(tmp_path, turns=2)
    out = tmp_path / "out"
    first = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    assert [m["from"] for m in first["conversations"]] == ["human", "gpt", "human", "gpt"]
    assert all(len(t) == 2 for t in read_prompt_file(out / "heldout.jsonl").items)


def test_humaneval_prompts_are_an_evaluation_prompt_file(tmp_path):
    build(tmp_path)
    he = read_prompt_file(tmp_path / "out" / "humaneval.jsonl")
    assert he.kind == "turns" and len(he.items) == 3
    assert he.items[0] == sources.humaneval_turns({"prompt": "def f0(x):\n    \"\"\"doc\"\"\"\n"})




def test_the_slice_takes_the_roles_and_openings_it_took_before_the_reader_learnt_more():
    """ShareGPT's file holds bing, chatgpt and user turns and replies before any human turn: the reader now
    reads them (issue 44), the recipe's seeded slice skips them as before (launch/real.sh's numbers)."""
    from dflash_dist.data.jsonl import Skip
    from dflash_dist.data.sources import usable
    conv = lambda *turns: {"conversations": [{"from": f, "value": "x"} for f in turns]}  # noqa: E731
    for record, reason in [(conv("human", "bing"), "unknown_role"), (conv("human", "chatgpt"), "unknown_role"),
                           (conv("user", "gpt"), "unknown_role"), (conv("gpt"), "not_user_first"),
                           (conv("system", "gpt", "human"), "not_user_first"), (conv("human"), "no_assistant")]:
        with pytest.raises(Skip) as info:
            usable(record, turns=1, max_chars=100)
        assert info.value.reason == reason, record
    assert usable(conv("human", "gpt"), turns=1, max_chars=100) == [{"role": "user", "content": "x"},
                                                                     {"role": "assistant", "content": "x"}]
