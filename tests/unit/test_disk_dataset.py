"""The on-disk dataset: round trip, validation of every corruption, atomic writes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dflash_dist.data import disk
from dflash_dist.data.dataset import TokenDataset
from dflash_dist.data.disk import DatasetError, DatasetWriter, open_dataset, write_dataset

VOCAB = 100


def make_dataset(n: int = 50, seed: int = 0) -> TokenDataset:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=n)  # includes empty samples
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(0, VOCAB, size=int(offsets[-1])).astype(np.uint32)
    mask = (rng.random(int(offsets[-1])) < 0.6).astype(np.uint8)
    return TokenDataset(tokens=tokens, offsets=offsets, loss_mask=mask, vocab_size=VOCAB)


@pytest.fixture
def written(tmp_path) -> tuple[Path, TokenDataset]:
    ds = make_dataset()
    return write_dataset(tmp_path / "ds", ds, meta={"tokenizer": "tiny", "skipped": {"over_length": 2}}), ds


def test_round_trip(written):
    path, ds = written
    got = open_dataset(path)
    for name in ("tokens", "offsets", "loss_mask"):
        assert np.array_equal(getattr(got, name), getattr(ds, name)), name
    assert isinstance(got.tokens, np.memmap) and not got.tokens.flags.writeable
    assert got.tokens.dtype == np.uint32 and got.offsets.dtype == np.int64 and got.loss_mask.dtype == np.uint8
    assert got.vocab_size == VOCAB and len(got) == len(ds)
    assert np.array_equal(got.num_supervised, ds.num_supervised)
    assert got.meta["skipped"] == {"over_length": 2} and got.meta["tokenizer"] == "tiny"
    assert got.meta["num_tokens"] == len(ds.tokens) and got.meta["format_version"] == disk.FORMAT_VERSION
    assert sorted(os.listdir(path.parent)) == ["ds"]  # no temporary left behind


def test_streamed_samples_equal_bulk_arrays(tmp_path):
    ds = make_dataset(seed=1)
    write_dataset(tmp_path / "a", (ds.sample(i) for i in range(len(ds))), vocab_size=VOCAB)
    got = open_dataset(tmp_path / "a")
    assert np.array_equal(got.offsets, ds.offsets) and np.array_equal(got.tokens, ds.tokens)


def test_supervised_counts_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "CHUNK", 7)  # samples straddle many chunks
    ds = make_dataset(n=300, seed=2)
    got = open_dataset(write_dataset(tmp_path / "ds", ds))
    assert np.array_equal(got.num_supervised, ds.num_supervised)


def test_existing_output_is_kept_unless_overwrite(written):
    path, ds = written
    with pytest.raises(FileExistsError):
        write_dataset(path, make_dataset(seed=3))
    assert np.array_equal(open_dataset(path).tokens, ds.tokens)
    new = make_dataset(seed=3)
    write_dataset(path, new, overwrite=True)
    assert np.array_equal(open_dataset(path).tokens, new.tokens)
    assert sorted(os.listdir(path.parent)) == ["ds"]


def edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def rewrite(path: Path, name: str, arr: np.ndarray) -> None:
    arr.tofile(path / name)


@pytest.mark.parametrize("name", ["tokens.bin", "offsets.bin", "loss_mask.bin", "meta.json"])
def test_missing_file(written, name):
    path, _ = written
    (path / name).unlink()
    with pytest.raises(DatasetError, match=name):
        open_dataset(path)


@pytest.mark.parametrize("name", ["tokens.bin", "offsets.bin", "loss_mask.bin"])
def test_truncated_file(written, name):
    path, _ = written
    size = (path / name).stat().st_size
    os.truncate(path / name, size - 1)
    with pytest.raises(DatasetError, match=rf"{name}: truncated"):
        open_dataset(path)


def test_wrong_mask_length(written):
    path, ds = written
    rewrite(path, "loss_mask.bin", np.append(ds.loss_mask, np.uint8(1)))
    with pytest.raises(DatasetError, match=r"loss_mask.bin: too long"):
        open_dataset(path)


def test_offsets_must_start_at_zero(written):
    path, ds = written
    bad = ds.offsets.copy()
    bad[0] = 1
    rewrite(path, "offsets.bin", bad)
    with pytest.raises(DatasetError, match=r"offsets.bin: offsets\[0\] is 1"):
        open_dataset(path)


def test_decreasing_offsets_name_the_sample(written):
    path, ds = written
    bad = ds.offsets.copy()
    i = int(np.flatnonzero(np.diff(ds.offsets) > 2)[5])  # sample i has >2 tokens
    bad[i + 1] = bad[i] - 1  # sample i now ends before it starts
    rewrite(path, "offsets.bin", bad)
    with pytest.raises(DatasetError, match=rf"offsets.bin: offsets decrease at sample {i} "):
        open_dataset(path)


def test_offsets_must_end_at_num_tokens(written):
    path, ds = written
    bad = ds.offsets.copy()
    bad[-1] -= 1
    rewrite(path, "offsets.bin", bad)
    with pytest.raises(DatasetError, match=r"offsets.bin: last offset"):
        open_dataset(path)


def test_token_id_out_of_vocab_names_the_sample(written, monkeypatch):
    monkeypatch.setattr(disk, "CHUNK", 16)  # the bad token is found in a later chunk, not the first
    path, ds = written
    bad = ds.tokens.copy()
    i = 30
    pos = int(ds.offsets[i]) + 1 if ds.offsets[i + 1] - ds.offsets[i] > 1 else int(ds.offsets[i])
    assert ds.offsets[i + 1] > pos
    bad[pos] = VOCAB
    rewrite(path, "tokens.bin", bad)
    with pytest.raises(DatasetError, match=rf"tokens.bin: token id {VOCAB} at token {pos} \(sample {i}\)"):
        open_dataset(path)


def test_mask_values_must_be_zero_or_one(written):
    path, ds = written
    bad = ds.loss_mask.copy()
    bad[-1] = 2
    rewrite(path, "loss_mask.bin", bad)
    with pytest.raises(DatasetError, match=r"loss_mask.bin: loss mask value 2"):
        open_dataset(path)


def test_bad_meta(written):
    path, _ = written
    edit_meta(path, vocab_size="100")
    with pytest.raises(DatasetError, match=r"meta.json: key 'vocab_size'"):
        open_dataset(path)
    edit_meta(path, vocab_size=VOCAB, format_version=99)
    with pytest.raises(DatasetError, match=r"meta.json: format_version 99"):
        open_dataset(path)


def test_writer_rejects_bad_samples(tmp_path):
    with DatasetWriter(tmp_path / "ds", vocab_size=10) as w:
        with pytest.raises(DatasetError, match="token id out of"):
            w.add(np.array([3, 10]), np.array([0, 1]))
        with pytest.raises(DatasetError, match="loss mask has 1 entries for 2 tokens"):
            w.add(np.array([3, 4]), np.array([1]))
        w.abort()
    assert os.listdir(tmp_path) == []


def test_interrupted_write_leaves_nothing_valid(tmp_path, monkeypatch):
    """An exception after the arrays are written but before the rename: no dataset, no leftovers."""
    def boom(path):
        raise OSError("disk full")
    monkeypatch.setattr(disk, "fsync_dir", boom)  # called after the data files and meta.json are written
    with pytest.raises(OSError, match="disk full"):
        write_dataset(tmp_path / "ds", make_dataset())
    assert os.listdir(tmp_path) == []


