"""A loopback HTTP proxy in front of the moto S3 server that behaves like an S3-compatible store
which does not understand aws-chunked uploads: it stores the chunk framing (chunk sizes, the
trailing checksum) as part of the object, as such stores were seen to do.

Recent AWS SDKs send uploads with `Content-Encoding: aws-chunked` and a trailing CRC checksum
unless request checksums are set to `when_required`. Moto decodes that framing, so the proxy hides
it from moto: it forwards the framed body as a plain payload. Everything else passes unchanged.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers that describe the aws-chunked framing; the proxy drops them so moto stores the raw bytes.
_FRAMING_HEADERS = {"x-amz-decoded-content-length", "x-amz-trailer", "x-amz-sdk-checksum-algorithm"}
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def _is_framed(headers) -> bool:
    encoding = (headers.get("Content-Encoding") or "").lower()
    return "aws-chunked" in encoding or (headers.get("x-amz-content-sha256") or "").startswith("STREAMING-")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and `Expect: 100-continue`, as curl expects
    server: _ProxyServer

    def log_message(self, format: str, *args) -> None:  # quiet: tests read their own output
        pass

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # HTTP trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._read_body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS and k.lower() != "expect"}
        if _is_framed(self.headers):
            self.server.framed_paths.append(self.path.split("?", 1)[0])
            headers = {k: v for k, v in headers.items() if k.lower() not in _FRAMING_HEADERS}
            encodings = [e.strip() for e in headers.pop("Content-Encoding", "").split(",") if e.strip()]
            if [e for e in encodings if e.lower() != "aws-chunked"]:
                headers["Content-Encoding"] = ",".join(e for e in encodings if e.lower() != "aws-chunked")
            headers["x-amz-content-sha256"] = "UNSIGNED-PAYLOAD"
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None,
                             headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        finally:
            upstream.close()
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_HEADERS and (key.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(key, value)
        if self.command != "HEAD":  # a HEAD answer's length is the object's, as upstream said
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    upstream_port: int
    framed_paths: list[str]


class ChunkManglingProxy:
    """`with ChunkManglingProxy(s3_server.port) as proxy:` then use proxy.endpoint_url."""

    def __init__(self, upstream_port: int) -> None:
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.upstream_port = upstream_port
        self._server.framed_paths = []
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-mangling-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def framed_paths(self) -> list[str]:
        """/bucket/key of every aws-chunked upload that passed through (and was stored with its framing)."""
        return list(self._server.framed_paths)

    def __enter__(self) -> ChunkManglingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
