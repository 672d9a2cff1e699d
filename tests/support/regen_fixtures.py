"""What the regeneration tests share: a tiny transformers target (module-scoped fixture), its
tokenizer, the command lines of a regeneration."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import TORCHRUN

from dflash_dist.bench.regenerate import make_target
from dflash_dist.data.regen.run import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("regen") / "target")


def fault_argv(target: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--input", str(src), "--output", str(out), "--engine", "hf",
            "--max-new-tokens", "12", "--on-length", "keep", "--chunk-size", "2", *extra]


def regen_argv(target: Path, src: Path, out: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--input", str(src), "--output", str(out), "--engine", "hf",
            "--max-new-tokens", "24", "--on-length", "keep", *extra]


def regen_cmd(nproc: int, argv: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "dflash_dist.data.regenerate", *argv]
    return TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", "-m", "dflash_dist.data.regenerate", *argv]


@pytest.fixture(scope="module")
def tok(target):
    return load_tokenizer(str(target))


def descendants_left(procs: dict[int, int]) -> list[int]:
    from dflash_dist.data.regen.reaper import _alive
    return [p for p, start in procs.items() if _alive(p, start)]
