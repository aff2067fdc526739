"""Typed rows from CSV catalog files: every bad cell is reported with its file, line and column."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from datetime import date
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tunecast.errors import ConfigError, Problem

RowT = TypeVar("RowT", bound="CatalogRow")


class CatalogRow(BaseModel):
    """Base of every catalog row: immutable, no unknown columns, a dated source on every row."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    as_of: date
    source: str
    notes: str = ""

    @classmethod
    def columns(cls) -> list[str]:
        """Column order of the CSV files and JSON documents: the row's own fields, then provenance."""
        provenance = ["as_of", "source", "notes"]
        return [name for name in cls.model_fields if name not in provenance] + provenance

    def document(self) -> dict[str, object]:
        """The row as JSON-ready data, in column order."""
        data = self.model_dump(mode="json")
        return {name: data[name] for name in self.columns()}

    @field_validator("source")
    @classmethod
    def _source_present(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("every row needs a source (a URL or a citation)")
        return value.strip()


def _clean(cell: str | None) -> str | None:
    """Empty cells mean 'not known / not offered'."""
    if cell is None:
        return None
    cell = cell.strip()
    return cell or None


def parse_rows(text: str, row_type: type[RowT], source_name: str) -> list[RowT]:
    """Parse CSV text into `row_type` rows; collect every problem and raise them together."""
    reader = csv.DictReader(io.StringIO(text))
    expected = set(row_type.model_fields)
    header = reader.fieldnames or []
    problems: list[Problem] = []
    unknown = [column for column in header if column not in expected]
    missing = [
        name for name, field in row_type.model_fields.items() if field.is_required() and name not in header
    ]
    for column in unknown:
        problems.append(
            Problem(f"{source_name}: column {column}", "unknown column",
                    f"use only these columns: {', '.join(row_type.model_fields)}")
        )
    for column in missing:
        problems.append(Problem(f"{source_name}: column {column}", "required column is missing",
                                f"add a {column} column"))
    if problems:
        raise ConfigError(source_name, problems)

    rows: list[RowT] = []
    for line_number, record in enumerate(reader, start=2):
        values = {key: _clean(value) for key, value in record.items() if key is not None}
        values = {key: value for key, value in values.items() if value is not None}
        try:
            rows.append(row_type.model_validate(values))
        except ValidationError as error:
            for item in error.errors():
                column = ".".join(str(part) for part in item["loc"]) or "row"
                problems.append(
                    Problem(f"{source_name}:{line_number} ({column})",
                            f"{item['msg']} (got {item.get('input')!r})",
                            f"correct the {column} cell on line {line_number}")
                )
    if problems:
        raise ConfigError(source_name, problems)
    return rows


def write_rows(rows: Sequence[CatalogRow], columns: Iterable[str]) -> str:
    """CSV text for `rows`, with None written as an empty cell."""
    buffer = io.StringIO()
    names = list(columns)
    writer = csv.DictWriter(buffer, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        data = row.model_dump()
        writer.writerow({name: _cell(data.get(name)) for name in names})
    return buffer.getvalue()


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ";".join(str(item) for item in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
