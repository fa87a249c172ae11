"""A local HTTP server on 127.0.0.1 serving test images and hostile endpoints, and images made in the test.

Routes: ``/img.png`` (a small PNG), ``/corrupt.png`` (not an image), ``/big`` (a body over any small limit, with its
Content-Length), ``/big-chunked`` (the same without one), ``/slow`` (answers only after ``slow_s``), ``/loop`` (a
redirect to itself), ``/hops/N`` (N redirects, then the PNG), ``/away`` (a redirect to ``localhost``, another host
name for the same server). ``hits`` counts the requests per path, so a test can tell that a refused URL was never
fetched.
"""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def png_bytes(size: tuple[int, int] = (8, 6), color=(200, 30, 40), mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (with one tiny IDAT): decoding it in full would take
    width * height bytes; only its header may be read."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


class MediaServer:
    """``with MediaServer() as srv: srv.url("/img.png")``."""

    def __init__(self, big_bytes: int = 300_000, slow_s: float = 30.0):
        self.png = png_bytes()
        self.big_bytes = big_bytes
        self.slow_s = slow_s
        self.hits: Counter = Counter()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict = None, length: bool = True) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body:
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path
                outer.hits[path] += 1
                try:
                    if path == "/img.png":
                        self._send(200, outer.png, {"Content-Type": "image/png"})
                    elif path == "/corrupt.png":
                        self._send(200, b"this is not a png" * 10, {"Content-Type": "image/png"})
                    elif path == "/big":
                        self._send(200, b"\0" * outer.big_bytes)
                    elif path == "/big-chunked":  # no Content-Length: the body ends when the connection closes
                        self.close_connection = True
                        self._send(200, b"", {"Connection": "close"}, length=False)
                        for _ in range(outer.big_bytes // 4096 + 1):
                            self.wfile.write(b"\0" * 4096)
                    elif path == "/slow":
                        outer._stop.wait(outer.slow_s)
                        self._send(200, outer.png)
                    elif path == "/loop":
                        self._send(302, headers={"Location": "/loop"})
                    elif path.startswith("/hops/"):
                        n = int(path.rsplit("/", 1)[1])
                        self._send(302, headers={"Location": f"/hops/{n - 1}" if n > 1 else "/img.png"})
                    elif path == "/away":
                        self._send(302, headers={"Location": f"http://localhost:{outer.port}/img.png"})
                    else:
                        self._send(404)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its limit): fine
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="media-server", daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> "MediaServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # wakes /slow handlers
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)
