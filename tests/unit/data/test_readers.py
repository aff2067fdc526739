"""Readers: every file kind, streaming, URLs, and where a bad row is."""

import json

import fsspec
import pytest

from tunecast.data import readers
from tunecast.data.readers import BadRow, Row, read_rows
from tunecast.errors import TunecastError

RECORDS = [{"text": f"row {i}\nwith a line break"} for i in range(50)]


def rows(source: str) -> list[Row | BadRow]:
    return list(read_rows(source))


def test_jsonl_counts_lines_and_reports_broken_ones(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"\n[1, 2]\n{"text": "c"}\n')
    result = rows(str(path))
    assert [type(r).__name__ for r in result] == ["Row", "BadRow", "BadRow", "Row"]
    assert result[1].line == 3 and "not valid JSON" in result[1].message  # type: ignore[union-attr]
    assert result[2].line == 4 and "expected a record" in result[2].message  # type: ignore[union-attr]
    assert result[3].line == 5 and result[3].number == 4


def test_json_array_is_streamed_across_chunks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(readers, "CHUNK_CHARS", 64)  # force many refills
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS, indent=4))
    result = rows(str(path))
    assert [r.data for r in result if isinstance(r, Row)] == RECORDS
    assert result[1].line == 5  # each record takes 3 lines after the opening bracket


def test_a_broken_json_array_names_the_line(tmp_path) -> None:
    path = tmp_path / "data.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": "b",}\n]\n')
    with pytest.raises(TunecastError, match="line 3"):
        rows(str(path))


def test_json_file_with_one_record_per_line_is_read_as_jsonl(tmp_path) -> None:
    path = tmp_path / "data.json"
    path.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert [r.data["text"] for r in rows(str(path)) if isinstance(r, Row)] == ["a", "b"]


def test_csv_parquet_and_a_saved_dataset(tmp_path) -> None:
    import datasets

    frame = datasets.Dataset.from_list(RECORDS)
    frame.to_csv(str(tmp_path / "data.csv"), index=False)
    frame.to_parquet(str(tmp_path / "data.parquet"))
    frame.save_to_disk(str(tmp_path / "saved"))
    for source in ("data.csv", "data.parquet", "saved"):
        assert [r.data for r in rows(str(tmp_path / source))] == RECORDS, source


def test_fsspec_urls(tmp_path) -> None:
    with fsspec.open("memory://bucket/data.jsonl", "w") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert len(rows("memory://bucket/data.jsonl")) == len(RECORDS)
    with pytest.raises(TunecastError, match="does not exist"):
        rows("memory://bucket/missing.jsonl")


def test_unknown_suffix_is_a_user_error(tmp_path) -> None:
    with pytest.raises(TunecastError, match="file type"):
        rows(str(tmp_path / "data.xlsx"))
