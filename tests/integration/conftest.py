from tests.s3server import s3_endpoint, s3_url  # noqa: F401
