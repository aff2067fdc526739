"""Versions of other tools and libraries, as `runner_version` and `bitsandbytes_version` name them: how a version is
read, and the ranges of versions whose behaviour config/runner.py describes.

A version is dotted whole numbers (`0.13`, `1.7.1`, `v0.43.3`); anything after them (`rc1`, `.dev0`, `+cu121`) is
not part of what an estimate follows. Ranges are half-open, [since, until): `until` is the first version that
behaves otherwise, as the tools' changelogs and code put it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, ...]

_VERSION = re.compile(r"v?(\d+(?:\.\d+)*)(?:[.+-]?[A-Za-z][\w.+-]*)?")


def parse_version(text: str) -> Version | None:
    """The dotted numbers of `text` (`0.13` → (0, 13)), or None when it is not a version."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def _padded(version: Version, width: int) -> Version:
    return version + (0,) * (width - len(version))


def compare(a: Version, b: Version) -> int:
    """-1, 0 or 1 as `a` is older, the same as or newer than `b` (`0.13` and `0.13.0` are the same)."""
    width = max(len(a), len(b))
    left, right = _padded(a, width), _padded(b, width)
    return (left > right) - (left < right)


def show(version: Version) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True)
class VersionRange:
    """Versions from `since` (included) to `until` (excluded); None leaves that side open."""

    since: Version | None = None
    until: Version | None = None

    def contains(self, version: Version) -> bool:
        return ((self.since is None or compare(version, self.since) >= 0)
                and (self.until is None or compare(version, self.until) < 0))

    def text(self) -> str:
        if self.since is None and self.until is None:
            return "every version"
        if self.since is None:
            return f"before {show(self.until)}"  # type: ignore[arg-type]
        if self.until is None:
            return f"{show(self.since)} and later"
        return f"{show(self.since)} to before {show(self.until)}"
