"""The run directory before training (io.runlock.check_writable): under a regular file, read-only,
a read-only export or checkpoints directory; an export that cannot be written at the end."""
import errno

import pytest
import torch
from helpers import read_only

from dflash_dist.config import ConfigError, load_config
from dflash_dist.io.runlock import check_writable


def test_a_run_dir_under_a_regular_file_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"config key 'train.run_dir': cannot create .*/file/run: Not a directory"):
        check_writable(tmp_path / "file" / "run")


def test_a_read_only_run_dir_is_a_config_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    check_writable(ro)
    assert list(ro.iterdir()) == []  # the probe is removed
    with read_only(ro), pytest.raises(ConfigError, match=r"config key 'train.run_dir': .*/ro is not writable: "
                                                         r"(Operation not permitted|Permission denied)"):
        check_writable(ro)


@pytest.mark.parametrize("sub", ["export", "checkpoints"])
def test_a_read_only_export_or_checkpoints_directory_is_a_config_error(tmp_path, sub):
    (tmp_path / sub).mkdir()
    check_writable(tmp_path)
    with read_only(tmp_path / sub), pytest.raises(ConfigError, match=rf"config key 'train.run_dir': .*/{sub} is not "
                                                                    r"writable: (Operation not permitted|Permission denied)"):
        check_writable(tmp_path)
    assert list((tmp_path / sub).iterdir()) == []  # the probe is removed


def test_an_export_that_cannot_be_written_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch):
    """An export/ made read-only during the run (at start it is probed): exit 2 saying what to do."""
    from types import SimpleNamespace

    from dflash_dist.roles import reporter as reporting
    from dflash_dist.training.state import Totals

    def denied(spec, state, out_dir, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(out_dir / "model.safetensors"))
    monkeypatch.setattr(reporting, "export_drafter", denied)
    rep = reporting.Reporter.__new__(reporting.Reporter)  # only what export() reads
    rep.run, rep.state, rep.run_dir = SimpleNamespace(cfg=load_config(None, []), spec=None), \
        SimpleNamespace(totals=Totals()), tmp_path
    with pytest.raises(ConfigError, match=r"cannot write the export to .*/export: Permission denied; the final "
                                          r"checkpoint is saved: make the directory writable and start again with "
                                          r"train.resume=auto, which writes the export"):
        rep.export({"w": torch.zeros(2)})
