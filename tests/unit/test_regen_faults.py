"""Regeneration under faults and bad input (issue 29): numeric flags refused by range, the input fingerprinted
by content, a full disk at each write site (exit 2 naming the file, nothing hidden left, the same command
resumes), one run per --output, a run that produced nothing usable, the progress line's honesty; as real
processes (slow): a dead rank on another node, vLLM's engine processes outliving a killed rank, the launch
scripts' NPROC and TENSOR_PARALLEL."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

import pytest
from regen_fixtures import (
    fault_argv,
    target,  # noqa: F401  (fixtures)
)

from dflash_dist.bench.regenerate import conversations, write_jsonl
from dflash_dist.data.regen import chunks, cli
from dflash_dist.data.regen.progress import MIN_RATE_S, status_line


@pytest.fixture(scope="module")
def engine(target):
    from dflash_dist.data.regen.chat import stop_token_ids
    from dflash_dist.data.regen.engine import EngineSpec
    from dflash_dist.data.regen.engines import build_engine
    from dflash_dist.data.regen.run import generation_config, load_tokenizer
    stops = stop_token_ids(load_tokenizer(str(target)), generation_config(str(target)))
    return build_engine(EngineSpec(name="hf", target=str(target), tokenizer=str(target)), stops)


def hidden(*dirs: Path) -> list[str]:
    """Temporary files left behind (the parts directory's run lock is no partial file)."""
    return sorted(p.name for d in dirs if d.is_dir() for p in d.glob(".*") if p.name != ".lock")


# ----------------------------------------------------------------------------- flags and the resume key

@pytest.mark.parametrize("flag, value", [
    ("--progress-s", "0"), ("--progress-s", "-1"), ("--temperature", "inf"), ("--temperature", "nan"),
    ("--temperature", "-0.5"), ("--top-p", "0"), ("--top-p", "1.5"), ("--kv-cache-gib", "0"),
    ("--kv-cache-gib", "nan"), ("--max-new-tokens", "0"), ("--chunk-size", "1.5"), ("--seed", "-1"),
    ("--gpu-memory-utilization", "2"), ("--max-num-seqs", "-3"), ("--dead-after-s", "0"), ("--heartbeat-s", "0"),
])
def test_numeric_flags_are_refused_by_their_range_before_any_work(tmp_path, capsys, flag, value):
    # Nothing exists at these paths: a refusal for any other reason would name a path, not the flag.
    code = cli.main(fault_argv(tmp_path / "no-target", tmp_path / "no.jsonl", tmp_path / "out.jsonl", flag, value))
    err = capsys.readouterr().err
    assert code == 2 and f"argument {flag}: must be" in err, err


def test_resume_key_holds_the_input_content(tmp_path):
    """An input edited in place with the same size and mtime (sed, then touch -r; cp -p) is another job."""
    from dflash_dist.data.regen.engine import EngineSpec, Sampling
    from dflash_dist.data.regen.run import Job, job_key
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(4, seed=1))
    job = Job(input=src, output=tmp_path / "out.jsonl", engine=EngineSpec(name="hf", target="t", tokenizer="t"),
              sampling=Sampling(8))
    before, st = job_key(job), src.stat()
    text = src.read_text()
    src.write_text(text.replace("a", "b", 1) if "a" in text else "x" + text[1:])
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert src.stat().st_size == st.st_size and src.stat().st_mtime_ns == st.st_mtime_ns
    assert job_key(job) != before


def test_progress_line_shows_no_rate_before_there_is_one_and_the_share_cut():
    early = status_line(10, 300, 4000, 5.0, 0.01, measured_s=MIN_RATE_S / 3, replies=40, cut=30)
    assert "ETA" in early and "tok/s" not in early and re.search(r"ETA \d", early) is None
    assert "30/40 replies cut at the token limit (75.0%)" in early
    later = status_line(150, 300, 40000, 200.0, 1.0, measured_s=MIN_RATE_S, replies=400, cut=100)
    assert later.endswith("200.0 tok/s  ETA 0:02:30")


# ------------------------------------------------------------------------- faults, one engine for all

class FullDisk:
    """os.fsync of the first file whose name matches `pattern` fails with ENOSPC, as a full disk makes a
    write or its fsync fail (every write site of a regeneration fsyncs before its rename)."""

    def __init__(self, monkeypatch, pattern: str):
        self.pattern, self.hit, self.real = re.compile(pattern), None, os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if self.hit is None and self.pattern.search(name):
            self.hit = name
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd)


@pytest.fixture(scope="module")
def whole(target, engine, tmp_path_factory) -> tuple[Path, bytes]:
    """The input and the output a run without faults writes."""
    d = tmp_path_factory.mktemp("whole")
    src = write_jsonl(d / "chats.jsonl", conversations(6, seed=4))
    assert cli.main(fault_argv(target, src, d / "out.jsonl"), engine=engine) == 0
    return src, (d / "out.jsonl").read_bytes()


@pytest.mark.parametrize("site, pattern", [
    ("the resume key", r"^\.key\.json\.tmp-"), ("a chunk's lines", r"^\.chunk-000001\.jsonl\.tmp-"),
    ("a chunk's counts", r"^\.chunk-000001\.json\.tmp-"), ("the meta file", r"^\.out\.meta\.json\.tmp-"),
    ("the merged output", r"^\.out\.jsonl\.tmp-"),
])
def test_full_disk_exits_2_naming_the_file_and_the_same_command_resumes(target, engine, whole, tmp_path,
                                                                         monkeypatch, caplog, site, pattern):
    src, expected = whole
    out = tmp_path / "out.jsonl"
    disk = FullDisk(monkeypatch, pattern)
    with caplog.at_level(logging.INFO):
        assert cli.main(fault_argv(target, src, out), engine=engine) == 2
    assert disk.hit, f"{site}: no write matched {pattern}"
    named = disk.hit.split(".tmp-")[0].lstrip(".")
    assert re.search(rf"cannot write \S*{re.escape(named)}: No space left on device", caplog.text), caplog.text
    assert not out.exists() and hidden(tmp_path, chunks.parts_dir(out)) == []
    monkeypatch.setattr(os, "fsync", disk.real)  # room again: the same command finishes the job
    assert cli.main(fault_argv(target, src, out), engine=engine) == 0
    assert out.read_bytes() == expected and chunks.meta_path(out).is_file()
    assert hidden(tmp_path) == [] and not chunks.parts_dir(out).exists()


def test_a_progress_file_that_cannot_be_written_costs_a_warning_not_the_run(target, engine, whole, tmp_path,
                                                                            monkeypatch, caplog):
    src, expected = whole
    out = tmp_path / "out.jsonl"
    disk = FullDisk(monkeypatch, r"^\.progress-rank0\.json\.tmp-")
    with caplog.at_level(logging.INFO):
        assert cli.main(fault_argv(target, src, out), engine=engine) == 0
    assert disk.hit and "progress-rank0.json (No space left on device)" in caplog.text
    assert out.read_bytes() == expected and hidden(tmp_path) == []


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(target, engine, tmp_path, caplog):
    """The second run starts while the first one generates (from inside its engine): refused with exit 2,
    naming the first run's host and pid; the first finishes unharmed."""
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(4, seed=2))
    out = tmp_path / "out.jsonl"
    second = []

    class Meanwhile:
        def __init__(self, inner):
            self.inner, self.context_len = inner, inner.context_len

        def serve(self, requests, sampling, on_reply):
            if not second:
                second.append(cli.main(fault_argv(target, src, out), engine=engine))
            return self.inner.serve(requests, sampling, on_reply)

    with caplog.at_level(logging.INFO):
        assert cli.main(fault_argv(target, src, out), engine=Meanwhile(engine)) == 0
    assert second == [2]
    assert re.search(rf"--output \S+ is in use by another run \(host \S+ pid {os.getpid()} since", caplog.text), \
        caplog.text
    assert json.loads(chunks.meta_path(out).read_text())["conversations_out"] == 4


def test_a_run_that_produced_nothing_usable_exits_2_and_counts_every_cut(target, engine, tmp_path, caplog):
    """--on-length drop at one new token cuts every reply: the run says so (exit 2), logs 20 skips and that
    the rest are not logged one by one, and its last line gives the total and the share cut."""
    src = write_jsonl(tmp_path / "chats.jsonl", conversations(24, seed=3))
    out = tmp_path / "out.jsonl"
    args = [a if a != "keep" else "drop" for a in fault_argv(target, src, out, "--chunk-size", "30")]
    args[args.index("--max-new-tokens") + 1] = "1"
    with caplog.at_level(logging.INFO):
        assert cli.main(args, engine=engine) == 2
    text = caplog.text
    assert text.count("skipped (cut)") == 20 and "later cut skips of this rank are not logged one by one" in text
    assert "24 of 24 generated replies reached the token limit (100.0%)" in text
    assert "holds no conversation: all 24 input lines were skipped" in text and "--on-length keep" in text


# ------------------------------------------------------------------------------ real processes (slow)


