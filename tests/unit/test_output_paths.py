"""check_output_path: every output flag is probed at start-up, so a bad one is exit 2 before any work."""
from __future__ import annotations

import pytest
from helpers import read_only

from dflash_dist.io.files import OutputPathError, check_output_path


def test_a_writable_path_is_returned_and_nothing_is_left_behind(tmp_path):
    assert check_output_path(str(tmp_path / "out.json"), "--json") == tmp_path / "out.json"
    assert list(tmp_path.iterdir()) == []


def test_a_missing_directory_names_the_flag_and_the_path(tmp_path):
    with pytest.raises(OutputPathError, match=r"^--json .*/nope/out.json: its directory .*/nope does not exist$"):
        check_output_path(tmp_path / "nope" / "out.json", "--json")


def test_a_directory_under_a_regular_file_or_a_directory_as_the_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"^--out .*/f/page.html: its directory .*/f is not a directory$"):
        check_output_path(tmp_path / "f" / "page.html", "--out")
    with pytest.raises(OutputPathError, match=r"^--out .*: is a directory, not a file$"):
        check_output_path(tmp_path, "--out")


def test_a_read_only_or_immutable_directory_is_caught_by_probing(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    with read_only(ro), pytest.raises(OutputPathError, match=r"^--json .*/ro/out.json: cannot write in .*/ro: "
                                                             r"(Operation not permitted|Permission denied)$"):
        check_output_path(ro / "out.json", "--json")
    assert list(ro.iterdir()) == []


def test_an_existing_read_only_file_is_caught_and_left_unchanged(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("old\n")
    with read_only(out), pytest.raises(OutputPathError, match=r"^--json .*/out.json: cannot overwrite it: "):
        check_output_path(out, "--json")
    assert out.read_text() == "old\n"
    check_output_path(out, "--json")
    assert out.read_text() == "old\n"


def test_it_is_a_value_error_so_callers_treat_it_as_bad_input():
    assert issubclass(OutputPathError, ValueError)


def test_an_output_folder_is_created_or_refused_naming_the_flag(tmp_path):
    from dflash_dist.io.files import check_output_dir
    assert check_output_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"^--out .*/f/r: cannot create it: Not a directory$"):
        check_output_dir(tmp_path / "f" / "r", "--out")
    ro = tmp_path / "ro"
    ro.mkdir()
    with read_only(ro):
        with pytest.raises(OutputPathError, match=r"^--out .*/ro/r: cannot create it: "):
            check_output_dir(ro / "r", "--out")
        with pytest.raises(OutputPathError, match=r"^--out .*/ro: cannot write in it: "):
            check_output_dir(ro, "--out")


def test_make_parents_creates_the_directory_or_names_why_not(tmp_path):
    assert check_output_path(tmp_path / "a" / "b" / "out.json", "--json", make_parents=True)
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro"), pytest.raises(OutputPathError, match=r"^--json .*/ro/new: cannot create it: "):
        check_output_path(tmp_path / "ro" / "new" / "out.json", "--json", make_parents=True)
