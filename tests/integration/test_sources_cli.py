"""The real `python -m dflash_dist.data.sources` process: a slice larger than the data exits 2 naming
the flags."""
import subprocess
import sys

from corpora import corpus


def test_a_slice_larger_than_the_data_exits_2_naming_the_flags(tmp_path):
    sg, he = corpus(tmp_path)
    r = subprocess.run([sys.executable, "-m", "dflash_dist.data.sources", "--out", str(tmp_path / "o"),
                        "--train", "30", "--heldout", "5", "--sharegpt", str(sg), "--humaneval", str(he)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--train 30 --heldout 5: only 24 usable conversations" in r.stderr
    assert not (tmp_path / "o" / "train.jsonl").exists()
