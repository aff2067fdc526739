"""Storage tests run against a local folder, fsspec's memory filesystem and an S3 server (moto, on loopback;
see tests/s3server.py)."""

from __future__ import annotations

from tests.s3server import s3_endpoint, s3_url  # noqa: F401 - fixtures, registered by import
