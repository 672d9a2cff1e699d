"""The real `python -m dflash_dist.models.from_gguf` process on bad input: exit 2 naming the file or
the architecture."""
import subprocess
import sys

from gguf_fixtures import write_gguf


def test_missing_file_exits_2_naming_it(tmp_path):
    r = run_cli(tmp_path / "nope.gguf", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "nope.gguf: no such file" in r.stderr
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_exits_2(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf\n")
    r = run_cli(bad, tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "model.gguf: not a readable GGUF file" in r.stderr


def test_unsupported_architecture_exits_2_naming_it(tmp_path):
    r = run_cli(write_gguf(tmp_path / "odd.gguf", "frobnicator"), tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert "architecture 'frobnicator' cannot be loaded" in r.stderr and "llama" in r.stderr
    assert not (tmp_path / "out").exists()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_dist.models.from_gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
