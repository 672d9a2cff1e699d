"""`python -m dflash_dist.evaluate` refuses at start what it could only fail on at the end: a --json it
cannot write, and prompts longer than the target's context (issue 29, items 9 and 14)."""
from __future__ import annotations

import pytest
from evaluate_fixtures import B4, CPU, draft, prompts  # noqa: F401  (draft: a fixture)
from helpers import read_only
from test_evaluate_inputs import run

from dflash_dist.config import load_config
from dflash_dist.evaluation import hf_engine
from dflash_dist.evaluation.prompts import EvalInputError, PromptSet
from dflash_dist.models.build import build_drafter, build_target, draft_spec


def never(*a, **k):
    raise AssertionError("decoding started before the input was checked")


@pytest.mark.parametrize("where, says", [("missing/out.json", "its directory {d}/missing does not exist"),
                                         ("ro/out.json", "cannot write in {d}/ro: ")])
def test_an_unwritable_json_is_exit_2_before_anything_is_decoded(tmp_path, caplog, draft, monkeypatch, where, says):
    monkeypatch.setattr(hf_engine, "run_sets", never)
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"):
        rc, err = run(["--draft", str(draft), "--json", str(tmp_path / where), B4], caplog)
    assert rc == 2 and f"--json {tmp_path / where}: {says.format(d=tmp_path)}" in err, err


def test_prompts_that_fill_the_targets_context_are_refused_before_decoding(tmp_path, caplog, draft, monkeypatch):
    """The tiny target's 40,960 positions: a prompt of that many tokens (or more) cannot be answered; every
    such line is named, and nothing is decoded first."""
    monkeypatch.setattr(hf_engine, "warm_up", never)
    ctx = build_target(load_config(overrides=[B4]), CPU).max_position_embeddings
    path = prompts(tmp_path, f"[1, 2, 3]\n{[7] * ctx}\n[4, 5]\n{[7] * (ctx + 5)}\n")
    rc, err = run(["--draft", str(draft), "--bench", path, "--max-new-tokens", "2", B4], caplog)
    assert rc == 2, err
    assert (f"2 prompt(s) of at least the target's context of {ctx:,} positions, which it cannot answer: "
            f"{path}:2 ({ctx:,} tokens), {path}:4 ({ctx + 5:,} tokens); remove them from the set") in err, err


@pytest.fixture(scope="module")
def small_context():
    """The tiny target and a drafter, the target's context cut to 24 positions."""
    cfg = load_config(overrides=[B4])
    target = build_target(cfg, CPU)
    drafter = build_drafter(draft_spec(cfg, target), target, seed=1, device=CPU)
    target.max_position_embeddings = 24
    return target, drafter


def test_an_answer_stops_at_the_context_and_a_turn_past_it_is_named(small_context):
    target, drafter = small_context
    opts = hf_engine.Options(max_new_tokens=64)
    t, tokens = hf_engine.decode_answer(target, drafter, list(range(1, 21)), frozenset(), opts, "p.jsonl:1 turn 1")
    assert len(tokens) == t.new_tokens == 4  # 20 prompt tokens + 4 = the 24 positions
    with pytest.raises(EvalInputError, match=r"^p.jsonl:3 turn 2: prompt of 24 tokens >= the target's context "
                                             r"of 24 positions$"):
        hf_engine.decode_answer(target, drafter, list(range(1, 25)), frozenset(), opts, "p.jsonl:3 turn 2")


def test_the_context_check_counts_every_prompt_over_it(small_context):
    target, _ = small_context
    items = [[1] * n for n in (23, 24, 3, 40)]
    pset = PromptSet("p", "p.jsonl", "ids", items, [1, 2, 5, 9])
    with pytest.raises(EvalInputError, match=r"^2 prompt\(s\) .* context of 24 positions, which it cannot answer: "
                                             r"p.jsonl:2 \(24 tokens\), p.jsonl:9 \(40 tokens\);"):
        hf_engine.check_context(target.max_position_embeddings, [pset], None)
    hf_engine.check_context(target.max_position_embeddings, [PromptSet("q", "q.jsonl", "ids", items[:1], [1])], None)


def test_the_vllm_engine_refuses_prompts_past_its_context_before_any_engine_starts(tmp_path, caplog, monkeypatch):
    """--engine vllm applies the same rule at --max-model-len (else the target's context), before vLLM starts."""
    from evaluate_fixtures import target_overrides, untrained_export

    from dflash_dist.evaluation import vllm_engine
    monkeypatch.setattr(vllm_engine, "run_sets", never)
    target, fitting = untrained_export(tmp_path)  # a drafter of this target: the fit check passes
    path = prompts(tmp_path, f"[1, 2, 3]\n{list(range(1, 21))}\n")
    rc, err = run(["--draft", str(fitting), "--bench", path, "--engine", "vllm", "--max-model-len", "16",
                   *target_overrides(target)], caplog)
    assert rc == 2 and f"1 prompt(s) of at least the target's context of 16 positions, which it cannot answer: " \
                       f"{path}:2 (20 tokens)" in err, err


@pytest.mark.parametrize("variant, method, drafts", [("dflash", "dflash", 3), ("dspark", "dspark", 4)])
def test_the_vllm_engine_serves_each_variant_by_its_method_and_drafts(tmp_path, caplog, monkeypatch, variant, method,
                                                                      drafts):
    """The speculative_config vLLM gets is the export's variant's: DSpark drafts all B = 4 slots a block."""
    from evaluate_fixtures import target_overrides, untrained_export

    from dflash_dist.evaluation import vllm_engine
    seen = []

    def record(opts, *a, **k):
        seen.append(vllm_engine.speculative_config(opts, "dflash"))
        raise vllm_engine.EvalInputError("recorded")
    monkeypatch.setattr(vllm_engine, "run_sets", record)
    target, export = untrained_export(tmp_path, f"model.draft.variant={variant}")
    path = prompts(tmp_path, "[1, 2, 3]\n")
    rc, err = run(["--draft", str(export), "--bench", path, "--engine", "vllm", *target_overrides(target),
                   f"model.draft.variant={variant}"], caplog)
    assert rc == 2 and "recorded" in err, err
    assert seen == [{"method": method, "model": str(export), "num_speculative_tokens": drafts}]
