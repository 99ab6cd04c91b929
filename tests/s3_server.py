"""The loopback S3 server the tests use (shared with `raytrain-fast bench checkpoint`), and free ports."""

from __future__ import annotations

import socket

from raytrain_fast.bench.s3_server import ACCESS_KEY, REGION, SECRET_KEY, S3Server


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["ACCESS_KEY", "REGION", "S3Server", "SECRET_KEY", "free_port"]
