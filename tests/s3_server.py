"""The loopback S3 server the tests use (shared with `raytrain-fast bench checkpoint`), and free ports."""

from raytrain_fast.bench.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, free_port

__all__ = ["ACCESS_KEY", "REGION", "S3Server", "SECRET_KEY", "free_port"]
