import os

import pytest

from tunecast.atomic import write_text_atomic


def test_replaces_whole_file_and_leaves_no_temporary(tmp_path) -> None:
    path = tmp_path / "deep" / "offers.csv"
    write_text_atomic(path, "a\n")
    write_text_atomic(path, "b\n")
    assert path.read_text() == "b\n"
    assert os.listdir(path.parent) == ["offers.csv"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "models.csv"
    write_text_atomic(path, "old\n")

    def broken(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["models.csv"]
