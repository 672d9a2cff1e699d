"""The regeneration cache (data.target_corpus.cached_regenerate): a damaged file is named and made again."""
import logging

import numpy as np
import pytest
from helpers import flip_byte


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_regeneration_cache_file_is_named_and_regenerated(tmp_path, caplog, damage):
    from dflash_dist.data.dataset import TokenDataset
    from dflash_dist.data.target_corpus import cached_regenerate
    made = []

    def fn():
        made.append(1)
        tokens = np.arange(4000, dtype=np.int64) % 97
        return TokenDataset(tokens=tokens, offsets=np.array([0, 1500, 4000]), loss_mask=np.ones(4000, np.uint8),
                            vocab_size=97)
    first = cached_regenerate(tmp_path, {"k": 1}, fn)
    (f,) = tmp_path.glob("regen-*.npz")
    if damage == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)
    else:
        flip_byte(f, at=f.stat().st_size // 3)  # inside the tokens member: its CRC no longer matches
    with caplog.at_level(logging.WARNING, logger="dflash_dist.data.target_corpus"):
        again = cached_regenerate(tmp_path, {"k": 1}, fn)
    assert len(made) == 2 and f"cache file {f} is damaged" in caplog.text
    assert np.array_equal(again.tokens, first.tokens) and np.array_equal(again.offsets, first.offsets)
    cached_regenerate(tmp_path, {"k": 1}, fn)
    assert len(made) == 2, "the file made again is a cache hit"
