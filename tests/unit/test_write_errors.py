"""Issue 46, case 12, beyond from_gguf: a full disk under a library that raises its own error type
(safetensors' SafetensorError; torch.save's RuntimeError over its file's OSError) reaches every writer as
the OSError it stands for (`io.write_errors`), so the handlers that name the path catch it."""
from __future__ import annotations

import errno
import io
import logging

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from dflash_dist.bench import learning
from dflash_dist.io.files import atomic_write
from dflash_dist.io.write_errors import os_errors, write_error
from dflash_dist.models import export
from dflash_dist.models.drafter import DFlashDrafter, DraftSpec

# safetensors 0.8's own words for a full disk (save_file onto a full tmpfs)
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def test_a_library_error_carrying_the_os_error_is_that_os_error():
    err = write_error(SafetensorError(SAFETENSORS_FULL))
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.strerror == "No space left on device"
    wrapped = RuntimeError("unexpected pos 704 vs 598")
    wrapped.__context__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert write_error(wrapped).errno == errno.EDQUOT
    assert write_error(ValueError("not a write")) is None
    with pytest.raises(ValueError):  # anything else passes unchanged
        with os_errors():
            raise ValueError("not a write")


class FullFile:
    """A file object on a disk that fills after 4 KiB: the writes past it fail as the OS says it."""

    def __init__(self, f, room: int = 4096):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def test_torch_save_into_atomic_write_on_a_full_disk_is_an_os_error(tmp_path):
    """torch.save wraps its file's ENOSPC in a RuntimeError ("unexpected pos"): atomic_write's callers,
    whose `except OSError` keeps going (bench.learning's feature cache), get the OSError."""
    with pytest.raises(RuntimeError, match="unexpected pos"):  # what torch itself raises there
        torch.save([torch.zeros(10_000)], FullFile(io.BytesIO()))
    with pytest.raises(OSError) as exc:
        atomic_write(tmp_path / "f.pt", lambda f: torch.save([torch.zeros(10_000)], FullFile(f)))
    assert exc.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


class OneSample:
    lengths = np.array([3])

    def __len__(self):
        return 1


def test_the_feature_cache_on_a_full_disk_keeps_the_benchmark_going(tmp_path, monkeypatch, caplog):
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: real(obj, FullFile(f)))  # the real writer, a full disk
    monkeypatch.setattr(learning, "capture_for_drafter", lambda *a, **k: (torch.zeros(3, 4000), None))
    monkeypatch.setattr(learning, "collate", lambda ds, idx: None)  # one 3-token sample, features of zeros
    cache = tmp_path / "cache" / "features.pt"
    with caplog.at_level(logging.WARNING, logger="dflash_dist.bench.learning"):
        feats = learning.capture_all(None, OneSample(), [1], cache, None, final=False)
    assert len(feats) == 1 and "not cached" in caplog.text and list(cache.parent.iterdir()) == []


def test_an_export_on_a_full_disk_is_an_os_error_and_leaves_nothing(tmp_path, monkeypatch):
    """The reporter maps export_drafter's OSError to exit 2 naming the export's folder; safetensors'
    own error used to pass it by as a traceback."""
    def full(*args, **kwargs):
        raise SafetensorError(SAFETENSORS_FULL)
    monkeypatch.setattr(export, "save_file", full)
    spec = DraftSpec(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=8, rope_theta=10000.0, rms_eps=1e-6, block_size=4, mask_token_id=31,
                     target_layer_ids=(1,), num_target_layers=4)
    with pytest.raises(OSError) as exc:
        export.export_drafter(spec, DFlashDrafter(spec).state_dict(), tmp_path / "export", dtype=torch.float32)
    assert exc.value.errno == errno.ENOSPC and isinstance(exc.value.__cause__, SafetensorError)
    assert list(tmp_path.iterdir()) == []
