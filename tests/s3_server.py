"""The loopback S3 server the tests use (shared with `raytrain-fast bench checkpoint`)."""

from raytrain_fast.bench.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

__all__ = ["ACCESS_KEY", "REGION", "S3Server", "SECRET_KEY"]
