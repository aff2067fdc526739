"""Read training data row by row, without loading a file at once: JSONL, JSON (one array of records), CSV,
Parquet and a folder saved by `datasets`, from local paths or fsspec URLs (`s3://…`, `gs://…`, `https://…`).

Rows come out as `Row` (a record and where it was) or `BadRow` (what is wrong there); the caller decides
whether a bad row stops the run or is skipped and counted. Nothing is dropped silently.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunecast.errors import TunecastError

CHUNK_CHARS = 1 << 20
KINDS = ("jsonl", "json", "csv", "parquet", "datasets")


@dataclass(frozen=True)
class Row:
    number: int  # 1-based position among the records
    line: int | None  # 1-based line in a text file, where there is one
    data: dict[str, Any]


@dataclass(frozen=True)
class BadRow:
    number: int
    line: int | None
    message: str
    field: str | None = None
    hint: str | None = None

    @property
    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.number}"


def _is_url(source: str) -> bool:
    return "://" in source


def detect_kind(source: str) -> str:
    """The reader for `source`, from its suffix (a local folder is a `datasets` save)."""
    if not _is_url(source) and Path(source).is_dir():
        return "datasets"
    name = source.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(suffix)
    for suffix, kind in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".csv", "csv"),
                         (".tsv", "csv"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return kind
    raise TunecastError(f"cannot tell the file type of {source}", field="dataset.path",
                        hint="use a .jsonl, .json, .csv, .parquet file, or a folder saved by datasets' save_to_disk")


def _open_text(source: str) -> Any:
    import fsspec

    try:
        return fsspec.open(source, "rt", encoding="utf-8", compression="infer", newline="").open()
    except FileNotFoundError:
        raise TunecastError(f"{source} does not exist", field="dataset.path", hint="check the path or URL") from None
    except (OSError, ValueError, ImportError) as error:
        raise TunecastError(f"cannot open {source}: {error}", field="dataset.path",
                            hint="check the URL, its credentials, and that the fsspec backend is installed "
                                 "(pip install 'tunecast[s3]' for s3://)") from None


def read_rows(source: str) -> Iterator[Row | BadRow]:
    kind = detect_kind(source)
    if kind == "jsonl":
        yield from _jsonl(source)
    elif kind == "json":
        yield from _json(source)
    elif kind == "csv":
        yield from _csv(source)
    elif kind == "parquet":
        yield from _parquet(source)
    else:
        yield from _datasets(source)


def _record(number: int, line: int | None, value: Any) -> Row | BadRow:
    if isinstance(value, dict):
        return Row(number, line, value)
    return BadRow(number, line, f"expected a record ({{…}}), found {type(value).__name__}",
                  hint="each row must be a JSON object with the dataset's fields")


def _jsonl(source: str) -> Iterator[Row | BadRow]:
    number = 0
    with _open_text(source) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            number += 1
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                yield BadRow(number, line_number, f"not valid JSON ({error.msg} at column {error.colno})",
                             hint="fix or remove the line, or pass --skip-invalid to skip such rows")
                continue
            yield _record(number, line_number, value)


def _json(source: str) -> Iterator[Row | BadRow]:
    """A JSON file: one array of records, read element by element; a file of one object per line (JSONL
    saved as .json) is read as JSONL."""
    with _open_text(source) as handle:
        head = handle.read(CHUNK_CHARS)
        stripped = head.lstrip()
        if not stripped.startswith("["):
            handle.close()
            yield from _jsonl(source)
            return
        yield from _json_array(handle, head)


def _json_array(handle: Any, buffer: str) -> Iterator[Row | BadRow]:
    decoder = json.JSONDecoder()
    position = buffer.index("[") + 1
    line = 1 + buffer.count("\n", 0, position)
    number = 0
    while True:
        while True:  # skip whitespace and commas between elements, reading more when the buffer runs out
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                if buffer[position] == "\n":
                    line += 1
                position += 1
            if position < len(buffer):
                break
            more = handle.read(CHUNK_CHARS)
            if not more:
                raise TunecastError(f"the JSON array ends without ']' (line {line})", field="dataset.path",
                                    hint="the file is cut short; re-export it")
            buffer, position = buffer[position:] + more, 0
        if buffer[position] == "]":
            return
        while True:
            try:
                value, end = decoder.raw_decode(buffer, position)
                break
            except json.JSONDecodeError as error:
                more = handle.read(CHUNK_CHARS)
                if not more:
                    bad_line = line + buffer.count("\n", position, error.pos)
                    raise TunecastError(
                        f"not valid JSON at line {bad_line} ({error.msg}); a broken element of a JSON array "
                        "cannot be skipped", field="dataset.path",
                        hint="fix the file, or convert it to JSONL (one record per line) so that "
                             "--skip-invalid can skip broken rows") from None
                buffer, position = buffer[position:] + more, 0
        number += 1
        yield _record(number, line, value)
        line += buffer.count("\n", position, end)
        position = end
        if position > CHUNK_CHARS:
            buffer, position = buffer[position:], 0


def _csv(source: str) -> Iterator[Row | BadRow]:
    with _open_text(source) as handle:
        dialect = "excel-tab" if source.lower().removesuffix(".gz").endswith(".tsv") else "excel"
        reader = csv.DictReader(handle, dialect=dialect)
        start_line = 2
        try:
            for number, record in enumerate(reader, start=1):
                if None in record:
                    yield BadRow(number, start_line,
                                 f"has more fields than the header's {len(reader.fieldnames or [])}",
                                 hint="quote fields that contain commas or line breaks")
                else:
                    yield Row(number, start_line, {k: v for k, v in record.items() if k is not None})
                start_line = reader.line_num + 1
        except csv.Error as error:  # the file cannot be read on from here (a quote never closed, a huge field)
            raise TunecastError(f"not valid CSV from line {start_line} ({error})", field="dataset.path",
                                hint="check the quoting on that line, or convert the file to JSONL") from None


def _parquet(source: str) -> Iterator[Row | BadRow]:
    import fsspec
    import pyarrow.parquet as pq

    number = 0
    with fsspec.open(source, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        for batch in parquet.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                number += 1
                yield Row(number, None, record)


def _datasets(source: str) -> Iterator[Row | BadRow]:
    try:
        import datasets
    except ImportError:
        raise TunecastError("reading a saved dataset folder needs the datasets package", field="dataset.path",
                            hint="pip install datasets") from None
    try:
        loaded = datasets.load_from_disk(source)
    except FileNotFoundError:
        raise TunecastError(f"{source} is not a folder saved by datasets' save_to_disk", field="dataset.path",
                            hint="point at the folder save_to_disk wrote, or at a data file") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise TunecastError(f"{source} holds the splits {', '.join(loaded)} and no 'train' split",
                                field="dataset.path", hint="point at one split's folder")
        loaded = loaded["train"]
    for number, record in enumerate(loaded, start=1):
        yield Row(number, None, dict(record))
