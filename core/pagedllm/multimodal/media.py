"""Images from OpenAI ``image_url`` parts: ``data:`` URLs, ``http(s)`` fetches and ``file:`` paths (vLLM's
``MediaConnector``), decoded and verified with PIL.

Every way in is bounded, because a URL is chosen by the client: fetches have a total time limit, a byte limit (the
``Content-Length`` is refused unread when it is too big, and a body is read no further than the limit), a redirect
limit, and each hop's host must be in ``--allowed-media-domains`` when that is set (vLLM's flag; empty allows any
host); fetching can be turned off. ``file:`` URLs are refused unless the operator named a folder
(``--allowed-local-media-path``, vLLM's flag), and then only regular files inside it are read. An image's size is
read from its header and one over ``max_image_pixels`` is refused before it is decoded; it is then verified (a
corrupt or truncated file is an error, never half an image) and converted to RGB (transparency over white, as vLLM).

Every failure is one :class:`MediaError` naming the request field (``messages[0].content[1].image_url.url``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
import stat
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence
from urllib.parse import unquote, urljoin, urlsplit

from pagedllm.errors import ParamError

DEFAULT_FETCH_TIMEOUT = 5.0  # seconds for a whole fetch, redirects included (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)
DEFAULT_MAX_MEDIA_BYTES = 20 << 20  # an encoded image (OpenAI's limit per image)
DEFAULT_MAX_REDIRECTS = 5
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS: a 100-megapixel image is refused
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # what PIL may open (no EPS: it runs Ghostscript)
LOADS_PER_REQUEST = 8  # images of one request fetched / decoded at once
_CHUNK = 64 * 1024


class MediaError(ParamError):
    """A media input that cannot be used: ``field`` is the request's field path, ``code`` the OpenAI error code."""

    def __init__(self, field_name: str, message: str, code: str = "invalid_image"):
        super().__init__(field_name, message)
        self.code = code

    def __reduce__(self):  # crosses process boundaries with its code
        return MediaError, (self.field, self.message, self.code)


@dataclass(frozen=True)
class MediaConnector:
    """Where images may come from and how big they may be (the ``pagedllm serve`` media flags)."""

    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: Optional[Sequence[str]] = None  # None or empty: any host
    enable_fetch: bool = True  # --disable-media-fetch turns http(s) URLs off
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        path = self.allowed_local_media_path
        if path:
            if not os.path.isdir(path):  # vLLM refuses a missing folder or a file at start-up too
                raise ParamError("allowed_local_media_path", f"{path!r} is not an existing directory")
            object.__setattr__(self, "allowed_local_media_path", os.path.realpath(path))
        domains = tuple(d.strip().lower().rstrip(".") for d in (self.allowed_media_domains or ()) if d.strip())
        object.__setattr__(self, "allowed_media_domains", domains)
        if not self.fetch_timeout > 0:
            raise ParamError("media_fetch_timeout", f"must be > 0 seconds, got {self.fetch_timeout!r}")
        if not (isinstance(self.max_bytes, int) and self.max_bytes >= 1):
            raise ParamError("max_media_bytes", f"must be an integer >= 1, got {self.max_bytes!r}")
        if not (isinstance(self.max_redirects, int) and self.max_redirects >= 0):
            raise ParamError("media_max_redirects", f"must be an integer >= 0, got {self.max_redirects!r}")
        if not (isinstance(self.max_image_pixels, int) and self.max_image_pixels >= 1):
            raise ParamError("max_image_pixels", f"must be an integer >= 1, got {self.max_image_pixels!r}")

    # ---- the image of one URL ---------------------------------------------------------------------------------
    def load_image(self, url: str, field: str) -> Any:
        """The RGB ``PIL.Image`` of ``url`` (blocking; the offline API). A fetch runs on its own event loop in a
        helper thread, so this works whether or not the caller is inside an event loop."""
        scheme = _scheme(url, field)
        if scheme in ("http", "https"):
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="media-fetch") as pool:
                data = pool.submit(asyncio.run, self.fetch_bytes(url, field)).result()
        else:
            data = self._local_bytes(scheme, url, field)
        return decode_image(data, field, self.max_image_pixels)

    async def load_bytes_async(self, url: str, field: str) -> bytes:
        """The encoded bytes of ``url`` (fetched, or read on a thread), within the limits; not decoded."""
        scheme = _scheme(url, field)
        if scheme in ("http", "https"):
            return await self.fetch_bytes(url, field)
        return await asyncio.to_thread(self._local_bytes, scheme, url, field)

    async def load_image_async(self, url: str, field: str) -> Any:
        """The RGB ``PIL.Image`` of ``url``; fetching awaits the network and decoding runs on a thread, so the
        event loop is never held."""
        data = await self.load_bytes_async(url, field)
        return await asyncio.to_thread(decode_image, data, field, self.max_image_pixels)

    async def load_images_async(self, items: Sequence[tuple[str, str]], decode: bool = True) -> list[Any]:
        """The images of ``(url, field)`` items, loaded concurrently (``LOADS_PER_REQUEST`` at a time); the first
        failure cancels the others (no fetch outlives its request) and is raised. ``decode=False``: the encoded
        bytes (the server decodes them in its render workers)."""
        if not items:
            return []
        gate = asyncio.Semaphore(LOADS_PER_REQUEST)
        load = self.load_image_async if decode else self.load_bytes_async

        async def one(url: str, field: str) -> Any:
            async with gate:
                return await load(url, field)

        tasks = [asyncio.ensure_future(one(url, field)) for url, field in items]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:  # in request order, so the error named is the first bad part's when several fail
                if t.done() and t.exception() is not None:
                    raise t.exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- sources ----------------------------------------------------------------------------------------------
    def _local_bytes(self, scheme: str, url: str, field: str) -> bytes:
        if scheme == "data":
            return self._data_bytes(url, field)
        return self._file_bytes(url, field)

    def _data_bytes(self, url: str, field: str) -> bytes:
        head, sep, payload = url[5:].partition(",")
        if not sep:
            raise MediaError(field, "a data: URL needs a comma before its data ('data:image/png;base64,...')")
        params = [p.strip().lower() for p in head.split(";")]
        if params[-1] != "base64":
            raise MediaError(field, "only base64 data: URLs are supported ('data:image/png;base64,...')")
        mime = params[0]
        if mime and not mime.startswith("image/"):
            raise MediaError(field, f"a data: URL of type {mime!r} is not an image", code="unsupported_media_type")
        if len(payload) > 4 * (self.max_bytes // 3 + 1) + 4:
            raise MediaError(field, f"the image is larger than this server's limit of {self.max_bytes} bytes "
                                    "(--max-media-bytes)", code="media_too_large")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(field, "the data: URL's data is not valid base64") from None

    def _file_bytes(self, url: str, field: str) -> bytes:
        root = self.allowed_local_media_path
        if not root:
            raise MediaError(field, "file: URLs are refused by this server (the operator can allow a folder with "
                                    "--allowed-local-media-path)", code="local_media_not_allowed")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(field, "a file: URL must name a local path (file:///path)", code="local_media_not_allowed")
        path = os.path.realpath(unquote(parts.path))  # symlinks and '..' resolved before the check
        if os.path.commonpath([root, path]) != root:
            raise MediaError(field, "the file is outside --allowed-local-media-path", code="local_media_not_allowed")
        # One answer for missing, unreadable and special files, so a client cannot map the folder's contents.
        missing = MediaError(field, "no readable image file at this path under --allowed-local-media-path",
                             code="local_media_not_found")
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            raise missing from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
                raise missing
            if st.st_size > self.max_bytes:
                raise MediaError(field, f"the file has {st.st_size} bytes, more than this server's limit of "
                                        f"{self.max_bytes} (--max-media-bytes)", code="media_too_large")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:
            raise MediaError(field, f"the file is larger than this server's limit of {self.max_bytes} bytes "
                                    "(--max-media-bytes)", code="media_too_large")
        return data

    def check_host(self, url: str, field: str) -> None:
        """MediaError unless ``url`` is an http(s) URL whose host may be fetched."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaError(field, "a media URL must be http(s) with a host", code="invalid_media_url")
        if self.allowed_media_domains and parts.hostname.lower().rstrip(".") not in self.allowed_media_domains:
            raise MediaError(field, f"the host {parts.hostname!r} is not in this server's --allowed-media-domains",
                             code="media_domain_not_allowed")

    async def fetch_bytes(self, url: str, field: str) -> bytes:
        """The body at ``url`` (http/https) within the time, size and redirect limits; each hop's host is checked."""
        if not self.enable_fetch:
            raise MediaError(field, "this server does not fetch media URLs (--disable-media-fetch); send the image "
                                    "as a data: URL", code="media_fetch_disabled")
        self.check_host(url, field)
        try:
            import aiohttp
        except ImportError:
            raise MediaError(field, "fetching media URLs needs aiohttp (pip install 'pagedllm[serve]'); send the "
                                    "image as a data: URL", code="media_fetch_disabled") from None
        timeout = aiohttp.ClientTimeout(total=self.fetch_timeout)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await asyncio.wait_for(self._follow(session, url, field), self.fetch_timeout)
        except asyncio.TimeoutError:
            raise MediaError(field, f"fetching the image took longer than {self.fetch_timeout:g} s "
                                    "(--media-fetch-timeout)", code="media_fetch_timeout") from None
        except aiohttp.ClientError as e:
            raise MediaError(field, f"the image could not be fetched ({type(e).__name__})",
                             code="media_fetch_failed") from None

    async def _follow(self, session: Any, url: str, field: str) -> bytes:
        for hop in range(self.max_redirects + 1):
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status in (301, 302, 303, 307, 308):
                    location = resp.headers.get("Location")
                    if not location:
                        raise MediaError(field, f"the media URL answered {resp.status} without a Location",
                                         code="media_fetch_failed")
                    url = urljoin(str(resp.url), location)
                    self.check_host(url, field)  # a redirect may not leave the allowed domains
                    continue
                if resp.status != 200:
                    raise MediaError(field, f"the media URL answered HTTP {resp.status}", code="media_fetch_failed")
                size = resp.content_length
                if size is not None and size > self.max_bytes:
                    raise MediaError(field, f"the image has {size} bytes, more than this server's limit of "
                                            f"{self.max_bytes} (--max-media-bytes)", code="media_too_large")
                chunks, total = [], 0
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise MediaError(field, f"the image is larger than this server's limit of {self.max_bytes} "
                                                "bytes (--max-media-bytes)", code="media_too_large")
                    chunks.append(chunk)
                return b"".join(chunks)
        raise MediaError(field, f"the media URL redirected more than {self.max_redirects} times",
                         code="media_too_many_redirects")


def _scheme(url: str, field: str) -> str:
    if not isinstance(url, str) or not url:
        raise MediaError(field, "must be a non-empty URL string", code="invalid_media_url")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("http", "https", "data", "file"):
        raise MediaError(field, "the URL scheme must be http, https, data or file", code="invalid_media_url")
    return scheme


def decode_image(data: bytes, field: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """``data`` as a verified RGB ``PIL.Image``: its size is read from the header and checked before decoding; a
    file PIL cannot identify, fails to verify or that ends early is refused."""
    from PIL import Image, UnidentifiedImageError  # heavy: only when an image arrives

    _quiet_pil_bomb_warning(Image)

    def too_large(w: Optional[int] = None, h: Optional[int] = None) -> MediaError:
        dims = f"{w}x{h} = {w * h} pixels" if w else "more pixels than PIL decodes"
        return MediaError(field, f"the image has {dims}, more than this server's limit of {max_pixels} "
                                 "(--max-image-pixels)", code="image_too_large")

    def corrupt(why: str) -> MediaError:
        return MediaError(field, f"the image cannot be decoded: {why}", code="invalid_image")

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as probe:  # reads the header only
            w, h = probe.size
            if w * h > max_pixels:
                raise too_large(w, h)
            probe.verify()  # checksums and structure, without decoding the pixels
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        img.load()  # a truncated file raises here (ImageFile.LOAD_TRUNCATED_IMAGES is left False)
        return to_rgb(img)
    except MediaError:
        raise
    except Image.DecompressionBombError:
        raise too_large() from None
    except UnidentifiedImageError:
        raise corrupt(f"not an image in a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises on a hostile file, it is the file's fault
        raise corrupt(str(e) or type(e).__name__) from None


def _quiet_pil_bomb_warning(image_module: Any) -> None:
    """PIL warns about images over its own limit when it reads their header; the limit enforced here is
    ``max_image_pixels`` (refused with a 400), so the warning would only repeat it in the server log. (Adding the
    same filter again replaces it.)"""
    warnings.filterwarnings("ignore", category=image_module.DecompressionBombWarning)


def to_rgb(img: Any) -> Any:
    """RGB, transparent pixels over white (vLLM's ``rgba_background_color`` default)."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return img.convert("RGB")
