"""Regeneration of agentic and weighted chats (issue 44 item 2): tool results kept as recorded, the
assistant's turns regenerated with the line's tools given to the chat template, the target's ids stored;
weight-0 and leading assistant turns kept as context. A scripted engine stands in for the target: it
records each prompt it is given and answers with fixed replies (tokenized by the Qwen3-style ChatML
tokenizer built in the test)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_fixtures import TEMPLATE, make_chatml_tokenizer, make_tokenizer
from test_chat_reader import AGENT, TOOLS
from transformers import PreTrainedTokenizerFast

from dflash_dist.data.jsonl import read_chat_line
from dflash_dist.data.prepare import Skip
from dflash_dist.data.regen.chat import ChatRenderer, parse_line
from dflash_dist.data.regen.engine import EngineSpec, Generated, Sampling, serve_in_waves
from dflash_dist.data.regen.progress import RankProgress
from dflash_dist.data.regen.run import ChunkWorker, Job

CALL_REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(make_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


class ScriptedEngine:
    """Answers the n-th request with replies[n]; keeps every prompt, decoded."""
    context_len = 4096

    def __init__(self, tok, replies: list[str]):
        self.tok, self.replies, self.prompts = tok, replies, []

    def generate(self, prompts, max_tokens, sampling, seeds):
        out = []
        for p in prompts:
            self.prompts.append(self.tok.decode(p))
            out.append(Generated(self.tok(self.replies[len(self.prompts) - 1], add_special_tokens=False)["input_ids"],
                                 True))
        return out

    def serve(self, requests, sampling, on_reply):
        serve_in_waves(self, requests, sampling, on_reply)


def regenerate(tok, tmp_path: Path, lines: list[dict], replies: list[str]):
    engine = ScriptedEngine(tok, replies)
    job = Job(input=tmp_path / "in.jsonl", output=tmp_path / "out.jsonl", sampling=Sampling(64),
              engine=EngineSpec(name="hf", target="-", tokenizer="-"), on_length="keep")
    worker = ChunkWorker(job, engine, ChatRenderer(tok), RankProgress(tmp_path, rank=0))
    out, counts = worker.run([(n, json.dumps(line).encode()) for n, line in enumerate(lines, start=1)])
    return [json.loads(line) for line in out], counts, engine.prompts


def test_tool_turns_are_kept_and_the_assistant_regenerated_with_the_lines_tools(tok, tmp_path):
    got, counts, prompts = regenerate(tok, tmp_path, [AGENT], [CALL_REPLY, "three."])
    # Turn 1's prompt: the tools in the system turn, as the target is served with them.
    assert prompts[0].startswith("<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(TOOLS[0]))
    # Turn 2's prompt: the target's own call, then the tool's result as recorded.
    assert prompts[1].endswith(CALL_REPLY + "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response>"
                               "<|im_end|>\n<|im_start|>assistant\n")
    msgs = got[0]["messages"]
    assert msgs[2] == AGENT["messages"][2]  # the tool result, untouched
    assert msgs[1]["content"] == CALL_REPLY and "tool_calls" not in msgs[1]  # the target wrote its own call
    assert msgs[1]["token_ids"] == tok(CALL_REPLY, add_special_tokens=False)["input_ids"]
    assert msgs[3]["content"] == "three." and msgs[3]["finish_reason"] == "stop"
    assert counts["tool_calls_replaced"] == 1 and counts["replies_generated"] == 2 and counts["tools_not_rendered"] == 0
    _, messages = read_chat_line(json.dumps(got[0]))  # and prepare reads the output back
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]


def test_a_sharegpt_function_call_turn_becomes_the_targets_gpt_turn(tok, tmp_path):
    line = {"tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "add 1 and 2"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"}, {"from": "gpt", "value": "it is 3."}]}
    got, counts, prompts = regenerate(tok, tmp_path, [line], [CALL_REPLY, "three."])
    conv = got[0]["conversations"]
    assert conv[1]["from"] == "gpt" and conv[1]["value"] == CALL_REPLY and conv[2] == line["conversations"][2]
    assert "# Tools" in prompts[0] and counts["tool_calls_replaced"] == 1
    read_chat_line(json.dumps(got[0]))  # still a valid line


def test_weight_zero_and_leading_turns_are_kept_as_recorded(tok, tmp_path):
    line = {"messages": [{"role": "assistant", "content": "hello, i am a bot."},
                         {"role": "user", "content": "q"}, {"role": "assistant", "content": "old.", "weight": 0},
                         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old too."}]}
    got, _, prompts = regenerate(tok, tmp_path, [line], ["new."])
    assert len(prompts) == 1 and "old.<|im_end|>" in prompts[0] and "hello, i am a bot." in prompts[0]
    assert got[0]["messages"][:4] == line["messages"][:4] and got[0]["messages"][4]["content"] == "new."


def test_reasoning_under_any_name_is_dropped_from_a_regenerated_turn(tok, tmp_path):
    line = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]}
    got, counts, _ = regenerate(tok, tmp_path, [line], ["<think>\nmine\n</think>\n\nb"])
    assert "reasoning" not in got[0]["messages"][1] and counts["reasoning_content_dropped"] == 1


def test_tools_the_template_ignores_are_counted(tmp_path):
    plain = PreTrainedTokenizerFast.from_pretrained(make_tokenizer(tmp_path / "tok", TEMPLATE))
    line = {"tools": TOOLS, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}
    _, counts, _ = regenerate(plain, tmp_path, [line], ["ok."])
    assert counts["tools_not_rendered"] == 1


def test_a_pre_tokenized_row_has_nothing_to_regenerate():
    with pytest.raises(Skip) as info:
        parse_line(1, b'{"input_ids": [1, 2], "loss_mask": [0, 1]}')
    assert info.value.reason == "pre_tokenized"


def test_regeneration_refuses_a_file_that_is_not_jsonl(tmp_path):
    from dflash_dist.data.regen.cli import check_paths
    src = tmp_path / "chats.jsonl"
    src.write_bytes(b"PAR1" + bytes(64))  # a parquet file under a .jsonl name
    job = Job(input=src, output=tmp_path / "out.jsonl", sampling=Sampling(8),
              engine=EngineSpec(name="hf", target=str(tmp_path), tokenizer=str(tmp_path)))
    with pytest.raises(ValueError, match=r"chats\.jsonl:1: not a JSONL file: it looks like a parquet file"):
        check_paths(job, overwrite=False)
