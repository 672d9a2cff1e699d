"""Chat regeneration without an engine: the thinking flag and past reasoning follow the template, stop
tokens come from the generation config, tokenizer and template, progress rates start with the tokens."""
from __future__ import annotations

import json

from regen_fixtures import target, tok  # noqa: F401  (fixtures)

from dflash_dist.data.regen.chat import ChatRenderer, parse_line, stop_token_ids
from dflash_dist.data.regen.run import generation_config


def test_thinking_flag_and_past_reasoning_follow_the_template(tok, tmp_path):
    conv = parse_line(1, json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nyes"},
        {"role": "user", "content": "why"}, {"role": "assistant", "content": "x"}]}))
    text = lambda r, k: tok.decode(r.prompt_ids(conv, k))  # noqa: E731
    assert text(ChatRenderer(tok, enable_thinking=False), 1).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert text(ChatRenderer(tok), 1).endswith("<|im_start|>assistant\n")
    # The second turn's prompt holds the first reply without its reasoning, as the template renders it.
    assert "<|im_start|>assistant\nyes<|im_end|>" in text(ChatRenderer(tok), 3) and "hm" not in text(ChatRenderer(tok), 3)


def test_stop_tokens_come_from_generation_config_tokenizer_and_template(tok, target):
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    assert stop_token_ids(tok, generation_config(str(target))) == [eot]
    assert stop_token_ids(tok, {"eos_token_id": [pad, eot]}) == sorted({pad, eot})


def test_progress_rates_start_when_the_tokens_do(tmp_path):
    from dflash_dist.data.regen.progress import RankProgress, Reporter, status_line
    (tmp_path / "chunk-000000.json").write_text('{"lines": 20}')  # finished by an earlier run
    rep = Reporter(tmp_path, total=100, done_before=20)
    RankProgress(tmp_path, rank=0)
    prog = RankProgress(tmp_path, rank=1)
    assert rep.rates(rep.t0 + 60, *rep.totals()) == (0.0, 0.0)  # a minute of engine start-up: nothing yet
    prog.add(conversations=5, tokens=500, flush=True)
    rep.rates(rep.t0 + 60, *rep.totals())  # the first tokens are seen here
    prog.add(conversations=10, tokens=1000, flush=True)
    done, tokens = rep.totals()
    assert (done, tokens) == (35, 1500)  # the earlier run's chunk + this run's conversations in hand
    tok_s, conv_s = rep.rates(rep.t0 + 70, done, tokens)
    assert (tok_s, conv_s) == (100.0, 1.0)  # over the 10 s since the first tokens, not the 70 s since start
    assert status_line(done, 100, tokens, tok_s, conv_s).endswith("ETA 0:01:05")
