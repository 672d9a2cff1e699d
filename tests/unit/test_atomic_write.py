"""io/files.py's atomic writes: the one file write (atomic_write) and the one directory write
(AtomicDir): nothing temporary left on failure, an existing destination replaced whole or refused, and
every file, the temporary directory and the parent fsynced."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_dist.io import files
from dflash_dist.io.files import TMP_TAG, AtomicDir, atomic_write, temp_sibling


class Boom(Exception):
    pass


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    """The paths os.fsync was called on, in order (the real fsync still runs)."""
    calls, real = [], os.fsync

    def record(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_temp_sibling_is_hidden_tagged_and_unique(tmp_path):
    a, b = temp_sibling(tmp_path / "x.json"), temp_sibling(tmp_path / "x.json")
    assert a.parent == tmp_path and a.name.startswith(f".x.json{TMP_TAG}{os.getpid()}-") and a != b


@pytest.mark.parametrize("data, expected", [("héllo\n", "héllo\n".encode()), (b"\x00\x01", b"\x00\x01"),
                                            (lambda f: f.write(b"via callback"), b"via callback")])
def test_file_write_replaces_an_existing_file_and_fsyncs_it_and_its_directory(tmp_path, synced, data, expected):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    before = path.stat().st_ino
    assert atomic_write(path, data) == path
    assert path.read_bytes() == expected and path.stat().st_ino != before  # a new file renamed over it
    assert os.listdir(tmp_path) == ["out.bin"]
    assert len(synced) == 2 and Path(synced[0]).name.startswith(".out.bin.tmp-") and synced[1] == str(tmp_path)


def test_file_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, synced):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def half(f):
        f.write(b"half a")
        raise Boom()
    with pytest.raises(Boom):
        atomic_write(path, half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"] and synced == []


def test_file_write_whose_fsync_fails_leaves_no_temporary(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write(tmp_path / "new.json", "{}")
    assert os.listdir(tmp_path) == []


def test_write_json_goes_through_the_file_write(tmp_path, synced):
    files.write_json(tmp_path / "s.json", {"x": float("nan")})
    assert (tmp_path / "s.json").read_text() == '{\n "x": null\n}\n' and len(synced) == 2


def test_dir_write_fsyncs_every_file_the_directory_and_the_parent(tmp_path, synced):
    dest = tmp_path / "ds"
    with AtomicDir(dest) as d:
        assert d.tmp.parent == tmp_path and d.tmp.name.startswith(".ds.tmp-")
        (d.tmp / "a.bin").write_bytes(b"a")
        (d.tmp / "sub").mkdir()
        (d.tmp / "sub" / "b.bin").write_bytes(b"b")
    assert sorted(os.listdir(tmp_path)) == ["ds"] and (dest / "sub" / "b.bin").read_bytes() == b"b"
    at = {Path(p).name if Path(p).parent != tmp_path else Path(p).name.split(TMP_TAG)[0]: i
          for i, p in enumerate(synced)}
    assert len(synced) == 5 and synced[-1] == str(tmp_path)  # two files, two directories, then the parent
    assert at["b.bin"] < at["sub"] < at[".ds"] and at["a.bin"] < at[".ds"]  # each directory after what it holds


def test_dir_write_that_fails_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with AtomicDir(tmp_path / "ds") as d:
            (d.tmp / "a.bin").write_bytes(b"a")
            raise Boom()
    assert os.listdir(tmp_path) == []


def test_dir_write_replaces_an_existing_directory_whole(tmp_path):
    dest = tmp_path / "ds"
    dest.mkdir()
    (dest / "old.bin").write_bytes(b"old")
    with AtomicDir(dest, replace=True) as d:
        (d.tmp / "new.bin").write_bytes(b"new")
    assert os.listdir(tmp_path) == ["ds"] and os.listdir(dest) == ["new.bin"]


def test_dir_write_refuses_an_existing_destination_without_replace(tmp_path):
    dest = tmp_path / "ds"
    d = AtomicDir(dest)
    dest.mkdir()  # appeared while it was being written
    (dest / "theirs").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="already exists"):
        d.commit()
    assert os.listdir(tmp_path) == ["ds"] and os.listdir(dest) == ["theirs"]


def test_dir_write_puts_the_old_directory_back_when_the_rename_fails(tmp_path, monkeypatch):
    dest = tmp_path / "ds"
    dest.mkdir()
    (dest / "old.bin").write_bytes(b"old")
    d = AtomicDir(dest, replace=True)
    real = os.replace

    def fails_into_place(src, dst):
        if Path(src) == d.tmp:
            raise OSError(5, "Input/output error")
        real(src, dst)
    monkeypatch.setattr(os, "replace", fails_into_place)
    with pytest.raises(OSError, match="Input/output"):
        d.commit()
    monkeypatch.undo()
    d.abort()
    assert os.listdir(tmp_path) == ["ds"] and (dest / "old.bin").read_bytes() == b"old"


def test_dir_write_with_a_fixed_temporary_removes_a_stale_one(tmp_path):
    stale = tmp_path / "step-1.tmp"
    stale.mkdir()
    (stale / "half.pt").write_bytes(b"half")
    with AtomicDir(tmp_path / "step-1", tmp=stale) as d:
        assert d.tmp == stale and os.listdir(stale) == []
        (d.tmp / "whole.pt").write_bytes(b"whole")
    assert os.listdir(tmp_path) == ["step-1"] and os.listdir(tmp_path / "step-1") == ["whole.pt"]


DEAD_PID = int(open("/proc/sys/kernel/pid_max").read()) + 1  # above the kernel's largest: no process has it


def test_a_killed_writers_temporaries_are_removed_by_the_next_write_of_the_same_destination(tmp_path):
    # what SIGKILL leaves: a half file and a half directory under this host's tag and a dead pid
    half_file = tmp_path / f".out.json.tmp-{DEAD_PID}-{files.HOST_TAG}00000001"
    half_file.write_text("{")
    half_dir = tmp_path / f".ds.tmp-{DEAD_PID}-{files.HOST_TAG}00000002"
    (half_dir / "sub").mkdir(parents=True)
    live = tmp_path / f".out.json.tmp-{os.getpid()}-{files.HOST_TAG}00000003"  # a writer still running
    remote = tmp_path / f".out.json.tmp-{DEAD_PID}-{'f' * 6 if files.HOST_TAG != 'f' * 6 else 'e' * 6}00000004"
    other = tmp_path / f".other.json.tmp-{DEAD_PID}-{files.HOST_TAG}00000005"  # another destination's
    for p in (live, remote, other):
        p.write_text("{")
    atomic_write(tmp_path / "out.json", "{}")
    with AtomicDir(tmp_path / "ds"):
        pass
    assert sorted(os.listdir(tmp_path)) == sorted(["out.json", "ds", live.name, remote.name, other.name])


def test_a_destination_moved_aside_by_a_killed_dir_write_is_put_back(tmp_path):
    # killed between AtomicDir's two renames: the old version aside, the new one not yet in place
    aside = tmp_path / f".ds.old-{DEAD_PID}-{files.HOST_TAG}00000001"
    aside.mkdir()
    (aside / "old.bin").write_bytes(b"old")
    assert files.remove_stale_temps(tmp_path / "ds") == [aside]
    assert os.listdir(tmp_path) == ["ds"] and (tmp_path / "ds" / "old.bin").read_bytes() == b"old"


def test_sigterm_under_terminate_cleanly_removes_the_temporaries_and_exits_143(tmp_path):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    files.terminate_cleanly()

    def killed_midway(f):
        f.write(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            f.write(b"more")
    try:
        with pytest.raises(SystemExit) as exit_:
            with AtomicDir(tmp_path / "ds") as d:
                atomic_write(d.tmp / "a.bin", killed_midway)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert exit_.value.code == 143 and os.listdir(tmp_path) == []
