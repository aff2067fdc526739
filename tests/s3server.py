"""An S3 endpoint for tests: moto's server on loopback, and a fresh bucket per test.

`s3_endpoint` (session) starts `moto.server.ThreadedMotoServer` on 127.0.0.1 at a free port (port 0, so
the kernel picks one; parallel sessions never collide), with fake AWS credentials and no user AWS config in
the environment, so nothing can reach real AWS. `s3_url` (per test) creates a bucket with a fresh name and
returns `s3://<bucket>/run`.

How s3fs finds the endpoint: `fsspec.config.conf["s3"] = {"endpoint_url": ...}`, set with `monkeypatch` for
the one test. fsspec applies `conf[protocol]` as default keyword arguments every time it creates a
filesystem (`fsspec.config.apply_config`, called from the filesystem metaclass), before its instance-cache
key is computed, so `Storage("s3://…")` in the code under test gets an `S3FileSystem` pointing at moto.
Checked with s3fs 2026.9 / aiobotocore 3.10. Alternatives, and why not:

- `FSSPEC_S3_ENDPOINT_URL`: fsspec reads `FSSPEC_*` variables once, when it is imported, which is long before
  a fixture runs; setting it later has no effect.
- `AWS_ENDPOINT_URL`: works (botocore reads it on client creation) but redirects every AWS client in the
  process, not only fsspec's.

Register in a conftest with `from tests.s3server import s3_endpoint, s3_url  # noqa: F401`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",  # the region where a bucket needs no LocationConstraint
    # a developer's own AWS config must not change which account or endpoint the tests talk to
    "AWS_CONFIG_FILE": "/nonexistent/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    # loopback never goes through a proxy
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
UNSET_AWS_ENV = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SECURITY_TOKEN")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """`http://127.0.0.1:<port>` of a moto S3 server running for the whole session (in-memory, threaded)."""
    pytest.importorskip("s3fs", reason="s3 tests need the dev extra: pip install -e '.[dev]'")
    moto_server = pytest.importorskip("moto.server", reason="s3 tests need the dev extra: pip install -e '.[dev]'")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FAKE_AWS_ENV.items():
            patch.setenv(name, value)
        for name in UNSET_AWS_ENV:
            patch.delenv(name, raising=False)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`s3://<fresh bucket>/run` on the moto server; fsspec's s3 filesystems use that server for this test."""
    import fsspec

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_endpoint})
    fs = fsspec.filesystem("s3")
    bucket = f"tunecast-test-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    yield f"s3://{bucket}/run"
    fs.invalidate_cache()
