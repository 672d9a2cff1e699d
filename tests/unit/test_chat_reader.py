"""The one reader of chat records (issue 44 cases 2, 3, 5, 8, 9, 10): reasoning under any of its three
names, OpenAI tool calls and tool results, a line's tools, ShareGPT function_call/observation turns, the
roles of the wild, SpecForge's role/content conversations, a leading assistant turn, OpenAI's per-message
weight, unknown keys counted, pre-tokenized rows. Rendered with a Qwen3-style ChatML tokenizer (thinking
and tools) built in the test."""
from __future__ import annotations

import json

import pytest
from chat_fixtures import make_chatml_tokenizer
from transformers import PreTrainedTokenizerFast

from dflash_dist.data import jsonl
from dflash_dist.data.jsonl import Skip, read_chat_line, template_view

TOOLS = [{"type": "function", "function": {"name": "add", "description": "sum of a and b",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}
AGENT = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "add 1 and 2"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "3"},
    {"role": "assistant", "content": "it is 3."}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(make_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


def rendered(tok, rec) -> str:
    return tok.apply_chat_template(template_view(rec.messages), tools=rec.tools, tokenize=False)


def record(obj):
    return jsonl.read_record(json.dumps(obj))


# -- case 2: reasoning under `reasoning` (vLLM's server) or `thinking` ----------------------------------------

@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_under_each_name_reaches_the_template(tok, key):
    line = {"messages": [{"role": "user", "content": "two plus two?"},
                         {"role": "assistant", "content": "four.", key: "two and two make four."}]}
    _, messages = read_chat_line(json.dumps(line))
    assert messages[1]["reasoning_content"] == "two and two make four."
    text = tok.apply_chat_template(template_view(messages), tokenize=False)
    assert "<think>\ntwo and two make four.\n</think>\n\nfour.<|im_end|>" in text
    notes = record(line).notes
    assert notes == ({} if key == "reasoning_content" else {f"reasoning_field:{key}": 1})


# -- case 3: agentic traces ----------------------------------------------------------------------------------

def test_openai_tool_calls_tool_results_and_tools_reach_the_template(tok):
    rec = record(AGENT)
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "tool", "assistant"]
    call = rec.messages[1]
    assert call["content"] == "" and call["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert rec.messages[2] == {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"}
    assert rec.tools == TOOLS
    text = rendered(tok, rec)
    assert '"description": "sum of a and b"' in text  # the tools, in the system turn
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>') in text


def test_tools_given_as_a_json_string_are_decoded_and_counted(tok):
    rec = record({**AGENT, "tools": json.dumps(TOOLS)})
    assert rec.tools == TOOLS and rec.notes["tools_json_string"] == 1
    assert rendered(tok, rec) == rendered(tok, record(AGENT))


def test_a_reply_with_text_and_a_call_keeps_its_call(tok):
    msgs = [dict(m) for m in AGENT["messages"]]
    msgs[1]["content"] = "let me add."
    _, messages = read_chat_line(json.dumps({"messages": msgs}))
    assert messages[1]["tool_calls"][0]["function"]["name"] == "add"
    text = tok.apply_chat_template(template_view(messages), tokenize=False)
    assert "let me add.\n<tool_call>\n" in text  # the turn does not end where the target writes its call


def test_sharegpt_function_call_and_observation_turns(tok):
    line = {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "add 1 and 2"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "it is 3."}]}
    rec = record(line)
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "tool", "assistant"]
    assert rec.messages[1] == {"role": "assistant", "content": "",
                               "tool_calls": [{"type": "function",
                                               "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert rec.notes["role:function_call->assistant"] == 1 and rec.notes["role:observation->tool"] == 1
    assert rendered(tok, rec) == rendered(tok, record(AGENT))  # the same trace as OpenAI's schema writes it


@pytest.mark.parametrize("line, reason", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, "bad_format"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]}, "bad_format"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}]}, "bad_format"),
    ({"tools": {"name": "add"}, "messages": AGENT["messages"]}, "bad_format"),
    ({"tools": "[{not json", "messages": AGENT["messages"]}, "bad_format"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "add(1, 2)"}]},
     "bad_format"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "3", "tool_call_id": 7},
                   {"role": "assistant", "content": "a"}]}, "bad_format"),
    ({"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "a"}]}, "unknown_role"),
])
def test_malformed_tool_data_is_a_counted_skip(line, reason):
    with pytest.raises(Skip) as info:
        jsonl.read_record(json.dumps(line))
    assert info.value.reason == reason


# -- cases 5, 9: the formats and roles users have -----------------------------------------------------------

def test_conversations_with_role_and_content_items():
    line = {"conversations": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a"}]}
    _, messages = read_chat_line(json.dumps(line))
    assert messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}]


@pytest.mark.parametrize("fmt, name, role", [
    ("messages", "developer", "system"), ("conversations", "chatgpt", "assistant"),
    ("conversations", "bing", "assistant"), ("conversations", "model", "assistant"),
    ("messages", "function", "tool")])
def test_roles_of_the_wild_are_mapped_and_counted(fmt, name, role):
    keys = ("role", "content") if fmt == "messages" else ("from", "value")
    msgs = [("user", "q"), (name, "x"), ("user", "q2"), ("assistant", "a")]
    line = {fmt: [dict(zip(keys, m)) for m in msgs]}
    _, messages = read_chat_line(json.dumps(line))
    assert [m["role"] for m in messages] == ["user", role, "user", "assistant"]
    assert record(line).notes[f"role:{name}->{role}"] == 1


def test_user_and_assistant_under_from():
    line = {"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]}
    _, messages = read_chat_line(json.dumps(line))
    assert messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_a_leading_assistant_greeting_is_unsupervised_context(tok):
    line = {"conversations": [{"from": "gpt", "value": "hello, how can i help?"}, {"from": "human", "value": "q"},
                              {"from": "gpt", "value": "a"}]}
    rec = record(line)
    assert rec.messages[0] == {"role": "assistant", "content": "hello, how can i help?", "weight": 0}
    assert "weight" not in rec.messages[2] and rec.notes["leading_assistant"] == 1
    assert rendered(tok, rec).startswith("<|im_start|>assistant\nhello, how can i help?<|im_end|>")
    with pytest.raises(Skip) as info:  # nothing else to supervise
        record({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hi"}]})
    assert info.value.reason == "no_assistant"


# -- case 10: OpenAI's per-message weight; unknown keys counted --------------------------------------------------

def test_weight_zero_turns_are_context_and_trailing_ones_are_cut():
    line = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad.", "weight": 0},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "good.", "weight": 1},
                         {"role": "user", "content": "more"}, {"role": "assistant", "content": "meh.", "weight": 0}]}
    rec = record(line)
    assert [m.get("weight") for m in rec.messages] == [None, 0, None, None]  # the last supervised turn ends it
    assert rec.notes["weight0_turns"] == 2
    assert "weight" not in template_view(rec.messages)[1]
    for bad in (2, True, "0"):
        with pytest.raises(Skip) as info:
            record({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                    "weight": bad}]})
        assert info.value.reason == "bad_format"


def test_unknown_per_message_keys_are_counted_and_null_ones_are_not():
    line = {"messages": [{"role": "user", "content": "q", "timestamp": 5},
                         {"role": "assistant", "content": "a", "refusal": None, "model": "x", "timestamp": 6}]}
    assert record(line).notes == {"unknown_key:timestamp": 2, "unknown_key:model": 1}


# -- case 8: pre-tokenized rows --------------------------------------------------------------------------------

def test_a_pre_tokenized_row_is_read_as_given():
    row = jsonl.read_record(b'{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}')
    assert isinstance(row, jsonl.Tokenized) and (row.input_ids, row.loss_mask) == ([5, 6, 7, 8], [0, 0, 1, 1])
    assert jsonl.read_record({"input_ids": [5, 6], "loss_mask": [False, True]}).loss_mask == [0, 1]


@pytest.mark.parametrize("row", [{"input_ids": [5, 6]}, {"input_ids": [5, 6], "loss_mask": [1]},
                                 {"input_ids": [5, -6], "loss_mask": [1, 1]},
                                 {"input_ids": [5, 6], "loss_mask": [1, 2]},
                                 {"input_ids": [], "loss_mask": []}, {"input_ids": "56", "loss_mask": [1, 1]}])
def test_a_malformed_pre_tokenized_row_is_bad_format(row):
    with pytest.raises(Skip) as info:
        jsonl.read_record(json.dumps(row))
    assert info.value.reason == "bad_format"


def test_rows_from_parquet_carry_nulls_for_absent_fields():
    """A parquet row holds every column of every message (null where a message has none): nulls lose nothing."""
    absent = {"tool_calls": None, "tool_call_id": None, "weight": None}
    row = {"messages": [{"role": "user", "content": "q", **absent}, {"role": "assistant", "content": "a", **absent}],
           "tools": None, "input_ids": None}
    rec = jsonl.read_record(row)
    assert rec.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert rec.tools is None and not rec.notes
