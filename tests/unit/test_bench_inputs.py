"""Issue 46, cases 4 and 5: the step benchmarks refuse a bad flag or a shape a variant refuses with exit 2
naming the flag before any timing, and every benchmark that writes a result file probes it before its
work (`bench.jobs.check_outputs`): an unwritable path is exit 2 naming the flag, not a traceback that
loses the measurement."""
from __future__ import annotations

import types

import pytest

from dflash_dist.bench import (
    anchors,
    attention,
    colocated,
    cost,
    dflash2_step,
    evaluate,
    gpu_check,
    memory,
    pipeline,
    plan,
    regenerate,
    transport,
    variant_step,
    vllm_cores,
)

STEP_BENCHES = {"variant_step": variant_step, "dflash2_step": dflash2_step}
SMALL = ["--seqs", "2", "--prompt", "8", "--reply", "24", "--num-anchors", "4", "--vocab", "512", "--hidden", "64",
         "--reps", "1", "--warmup", "0"]


def refuse(*args, **kwargs):
    raise AssertionError("the work began: the bad input was not refused first")


def exit_code(main, argv) -> int:
    """A tool's exit status whether it exits (argparse) or returns it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("bench", sorted(STEP_BENCHES))
@pytest.mark.parametrize("flag, value", [("--reps", "0"), ("--seqs", "0"), ("--num-anchors", "0"),
                                         ("--prompt", "0"), ("--reply", "0"), ("--warmup", "-1"), ("--vocab", "1"),
                                         ("--hidden", "0"), ("--reps", "x"),
                                         ("--vocab", "8"), ("--hidden", "20")])  # dflash2: top-16, groups of 16
def test_a_step_bench_refuses_a_bad_flag_naming_it_before_any_timing(bench, flag, value, tmp_path, monkeypatch,
                                                                    capsys):
    mod = STEP_BENCHES[bench]
    monkeypatch.setattr(mod, "time_interleaved", refuse)
    monkeypatch.setattr(mod, "make_batch", refuse)
    argv = [*SMALL, flag, value, "--json", str(tmp_path / "out.json")]
    if bench == "variant_step":
        argv += ["--variants", "dflash2"]
    assert exit_code(mod.main, argv) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("bench", sorted(STEP_BENCHES))
def test_a_step_bench_accepts_the_smallest_shapes_it_allows(bench, tmp_path):
    """The ranges' lower ends run: one sequence of a prompt token and a reply token, one anchor, vocabulary
    and hidden size just above what DFlash 2 refuses."""
    out = tmp_path / "out.json"
    argv = ["--seqs", "1", "--prompt", "1", "--reply", "1", "--num-anchors", "1", "--vocab", "16", "--hidden", "16",
            "--reps", "1", "--warmup", "0", "--json", str(out)]
    if bench == "variant_step":
        argv += ["--variants", "dflash2,dspark,domino,dflash+full"]
    assert STEP_BENCHES[bench].main(argv) == 0 and out.is_file()


# Each tool with the first piece of its work replaced by a refusal: exit 2 must come before it.
TOOLS = {
    "anchors": (anchors, "chat_lengths", []),
    "attention": (attention, "bench_target", []),
    "colocated": (colocated, "run_job", []),
    "cost": (cost, "load_config", []),
    "dflash2_step": (dflash2_step, "time_interleaved", SMALL),
    "evaluate": (evaluate, "load_config", []),
    "gpu_check": (gpu_check, "run_sections", ["--dry-run"]),
    "memory": (memory, "load_config", []),
    "pipeline": (pipeline, "measure", []),
    "plan": (plan, "run", []),
    "regenerate": (regenerate, "make_target", []),
    "transport": (transport, "mp", []),
    "variant_step": (variant_step, "time_interleaved", SMALL),
    "vllm_cores": (vllm_cores, "make_target", []),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_bench_probes_its_result_file_before_its_work(tool, tmp_path, monkeypatch, capsys):
    mod, work, argv = TOOLS[tool]
    monkeypatch.setattr(mod, work, types.SimpleNamespace(spawn=refuse) if work == "mp" else refuse)
    (tmp_path / "file").write_text("")  # a file where the output's folder would be
    assert exit_code(mod.main, [*argv, "--json", str(tmp_path / "file" / "sub" / "out.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_the_regenerate_bench_probes_its_scratch_folder_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(regenerate, "make_target", refuse)
    (tmp_path / "file").write_text("")
    assert exit_code(regenerate.main, ["--dir", str(tmp_path / "file" / "work"),
                                       "--json", str(tmp_path / "out.json")]) == 2
    assert "--dir" in capsys.readouterr().err


# One flag per tool set below its range: argparse's exit 2 naming it, before the work (refused as above).
BELOW_RANGE = {"anchors": ("--samples", "0"), "attention": ("--reps", "0"), "colocated": ("--nproc", "1"),
               "evaluate": ("--new-tokens", "0"), "gpu_check": ("--budget-s", "0"), "pipeline": ("--nproc", "0"),
               "plan": ("--max-seqs", "0"), "regenerate": ("--hidden", "16"), "transport": ("--sizes", "-1"),
               "vllm_cores": ("--reps", "0")}


@pytest.mark.parametrize("tool", sorted(BELOW_RANGE))
def test_every_bench_refuses_a_flag_below_its_range_naming_it(tool, tmp_path, monkeypatch, capsys):
    mod, work, argv = TOOLS[tool]
    monkeypatch.setattr(mod, work, types.SimpleNamespace(spawn=refuse) if work == "mp" else refuse)
    flag, value = BELOW_RANGE[tool]
    assert exit_code(mod.main, [*argv, flag, value, "--json", str(tmp_path / "out.json")]) == 2
    assert f"argument {flag}" in capsys.readouterr().err
