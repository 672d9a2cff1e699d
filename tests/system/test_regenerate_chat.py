"""Chat regeneration (dflash_dist.data.regen) on a tiny transformers Qwen3 target, float32 greedy:
vLLM and transformers give the same conversations; every assistant turn is the target's own greedy
continuation of the conversation before it; skips are counted by reason; a stopped run resumes to the
same output. One vLLM engine start is shared by the module (it costs seconds to a minute)."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
import vllm  # noqa: F401  (CI installs it: launch/test.sh runs VLLM=1 launch/setup.sh; a missing engine fails)
from regen_fixtures import target, tok  # noqa: F401  (fixtures)

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.prepare import parse_messages
from dflash_dist.data.regen import chunks
from dflash_dist.data.regen.chat import ChatRenderer, parse_line, stop_token_ids
from dflash_dist.data.regen.engine import EngineSpec, Sampling
from dflash_dist.data.regen.engines import build_engine
from dflash_dist.data.regen.run import Job, Shard, generation_config, run

MAX_NEW = 24
# The first test also starts vLLM (30-150 s on the shared 2-core machine, most of it compiling the model).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # starts a vLLM engine (30-150 s)


@pytest.fixture(scope="module")
def stops(tok, target):
    return stop_token_ids(tok, generation_config(str(target)))


@pytest.fixture(scope="module")
def engines(target, stops):
    spec = lambda name: EngineSpec(name=name, target=str(target), tokenizer=str(target), kv_cache_gib=0.25)  # noqa: E731
    return {name: (spec(name), build_engine(spec(name), stops)) for name in ("vllm", "hf")}


def job(engines, name, src: Path, out: Path, on_length="keep", chunk_size=8, thinking=None) -> tuple[Job, object]:
    spec, engine = engines[name]
    return Job(input=src, output=out, engine=spec, sampling=Sampling(MAX_NEW), on_length=on_length,
               enable_thinking=thinking, chunk_size=chunk_size, progress_s=1e9), engine


def regen(engines, name, src, out, **kw) -> tuple[list[dict], dict]:
    j, engine = job(engines, name, src, out, **kw)
    assert run(j, Shard(), engine) == 0
    meta = json.loads(chunks.meta_path(out).read_text())
    return [json.loads(line) for line in out.read_text().splitlines()], meta


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy by full recompute (no KV cache, no padding, no batching): one forward per token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_vllm_and_hf_give_identical_multi_turn_conversations(engines, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(40, seed=1))
    got_v, meta_v = regen(engines, "vllm", src, tmp_path / "v.jsonl")
    got_h, meta_h = regen(engines, "hf", src, tmp_path / "h.jsonl")
    assert (tmp_path / "v.jsonl").read_bytes() == (tmp_path / "h.jsonl").read_bytes()
    assert len(got_v) == 40 and [c["id"] for c in got_v] == list(range(40))  # input order, schema kept
    assert {k: v for k, v in meta_v.items() if k != "job"} == {k: v for k, v in meta_h.items() if k != "job"}
    multi = [c for c in got_v if sum(m.get("role") == "assistant" or m.get("from") == "gpt"
                                     for m in c.get("messages", c.get("conversations"))) > 1]
    assert len(multi) >= 10
    # Both endings occur: replies that stopped at the end-of-turn token and replies cut (kept) at the limit.
    assert 0 < meta_v["cut_kept"] < 40 and meta_v["replies"] > 40
    for c, orig in zip(got_v, conversations(40, seed=1)):
        assert c != orig and c["id"] == orig["id"] and set(c) == set(orig)


def test_every_turn_is_the_targets_greedy_continuation(engines, target, tok, stops, tmp_path):
    import transformers
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(12, seed=2))
    got, _ = regen(engines, "vllm", src, tmp_path / "out.jsonl")
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    renderer, checked = ChatRenderer(tok), 0
    for line_no, conv in enumerate(got, start=1):
        c = parse_line(line_no, json.dumps(conv))  # the output's own conversation, its turns the target's
        for k in c.turns:
            prompt = renderer.prompt_ids(c, k)
            reply = tok(c.messages[k]["content"], add_special_tokens=False)["input_ids"]
            want = greedy_reference(model, prompt, len(reply) + 1)
            assert reply == want[:len(reply)], (line_no, k)
            # It ended where the target ends its turn, or at the token limit (kept under --on-length keep).
            assert want[len(reply)] in stops if len(reply) < MAX_NEW else len(reply) == MAX_NEW
            checked += 1
    assert checked > 12


def test_skips_are_counted_by_reason_with_line_numbers(engines, tmp_path, caplog):
    good = conversations(6, seed=3)
    lines = [good[0], "", "{not json", {"messages": [{"role": "robot", "content": "x"}]}, good[1],
             {"messages": []}, {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "x"},
             {"messages": [{"role": "user", "content": "why " * 100}, {"role": "assistant", "content": "x"}]},
             good[2], good[3]]
    src = write_jsonl(tmp_path / "chats.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        got, meta = regen(engines, "hf", src, tmp_path / "out.jsonl", on_length="drop", chunk_size=4)
    want_skips = {"blank_line": 1, "bad_json": 1, "unknown_role": 1, "empty_conversation": 1, "no_assistant": 1,
                  "bad_format": 1, "over_context": 1}
    cut = meta["skipped"]["cut"]
    assert {k: v for k, v in meta["skipped"].items() if v and k != "cut"} == want_skips
    assert len(got) + cut == 4 and meta["conversations_out"] == len(got) and meta["input_lines"] == 11
    assert 0 < cut < 4 and meta["cut_kept"] == 0  # the tiny target runs on past the limit on some lines
    ids = [c["id"] for c in got]
    assert ids == sorted(ids) and set(ids) <= {good[i]["id"] for i in range(4)}  # input order
    for line_no, reason in [(3, "bad_json"), (4, "unknown_role"), (9, "over_context")]:
        assert f"chats.jsonl:{line_no}: skipped ({reason})" in caplog.text
    # Under keep the cut conversations stay, cut; nothing else changes.
    kept, meta_k = regen(engines, "hf", src, tmp_path / "kept.jsonl", on_length="keep", chunk_size=4)
    assert len(kept) == 4 and meta_k["cut_kept"] == cut and meta_k["skipped"]["cut"] == 0


class SignalAfter:
    """The shared engine, sending this process SIGTERM when its `after`-th reply ends."""

    def __init__(self, engine, after: int):
        self.engine, self.after, self.replies = engine, after, 0
        self.context_len = engine.context_len

    def serve(self, requests, sampling, on_reply):
        def counted(r, g):
            self.replies += 1
            if self.replies == self.after:
                os.kill(os.getpid(), signal.SIGTERM)
            return on_reply(r, g)
        self.engine.serve(requests, sampling, counted)


def test_a_stopped_run_resumes_to_the_same_output(engines, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(30, seed=4))
    whole, _ = regen(engines, "vllm", src, tmp_path / "whole.jsonl", chunk_size=8)
    out = tmp_path / "out.jsonl"
    j, engine = job(engines, "vllm", src, out, chunk_size=8)
    stopping = SignalAfter(engine, after=2)  # inside the first chunk: it is finished and written, then exit 75
    before = signal.getsignal(signal.SIGTERM)
    assert run(j, Shard(), stopping) == 75
    assert signal.getsignal(signal.SIGTERM) is before  # the test process's own handler is back
    parts = chunks.parts_dir(out)
    assert not out.exists() and sorted(p.name for p in parts.glob("chunk-*.json")) == ["chunk-000000.json"]
    # A crash inside chunk 1 left a temporary file and lines without their counts: chunk 1 is done again.
    (parts / ".chunk-000001.jsonl.tmp-1").write_text("half a li")
    (parts / "chunk-000001.jsonl").write_text("{}\n")
    again = SignalAfter(engine, after=-1)
    assert run(j, Shard(), again) == 0
    assert out.read_text().splitlines() == [json.dumps(c, ensure_ascii=False) for c in whole]
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes() and not parts.exists()
    turns = [sum(m["role"] == "assistant" for m in parse_messages(c)) for c in conversations(30, seed=4)]
    assert stopping.replies == sum(turns[:8])  # the stopped run did chunk 0, all of it, and no more
    assert again.replies == sum(turns[8:])  # the resumed run did not redo it


def test_rerun_with_other_settings_is_refused(engines, target, tmp_path):
    from dflash_dist.data.regenerate import main
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(6, seed=5))
    j, engine = job(engines, "hf", src, tmp_path / "out.jsonl", chunk_size=2)
    assert run(j, Shard(), SignalAfter(engine, after=1)) == 75
    args = ["--input", str(src), "--target", str(target), "--output", str(tmp_path / "out.jsonl"), "--engine", "hf",
            "--chunk-size", "2", "--on-length", "keep"]
    assert main(args + ["--max-new-tokens", "7"]) == 2  # another limit: the finished chunk would not fit
    assert main(args + ["--max-new-tokens", "0"]) == 2  # out of range: refused before any work
    missing = [str(tmp_path / "missing.jsonl") if a == str(src) else a for a in args]
    assert main(missing + ["--max-new-tokens", str(MAX_NEW)]) == 2  # an input file that is not there
    assert main(args + ["--max-new-tokens", str(MAX_NEW)]) == 0  # the same settings: resumed and merged
    assert main(args + ["--max-new-tokens", str(MAX_NEW)]) == 2  # the output exists now
    whole, _ = regen(engines, "hf", src, tmp_path / "whole.jsonl", chunk_size=2)
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


def test_sampled_vllm_replies_do_not_depend_on_chunking(engines, tmp_path):
    """A sampled reply's seed is (--seed, its line, its turn), given to vLLM per request: another chunking
    (so other batches) gives the same output, another --seed another one."""
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(16, seed=6))
    spec, engine = engines["vllm"]
    outs = {}
    for name, chunk_size, seed in [("a", 4, 3), ("b", 16, 3), ("c", 4, 4)]:
        j = Job(input=src, output=tmp_path / f"{name}.jsonl", engine=spec, on_length="keep", chunk_size=chunk_size,
                sampling=Sampling(MAX_NEW, temperature=1.0, top_p=0.9, seed=seed), progress_s=1e9)
        assert run(j, Shard(), engine) == 0
        outs[name] = (tmp_path / f"{name}.jsonl").read_bytes()
    assert outs["a"] == outs["b"] and outs["a"] != outs["c"]


