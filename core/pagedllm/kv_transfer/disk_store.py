"""The disk tier: one file per KV block, safe to share between engines (restarts, or two at once on one folder).

Files live under ``<dir>/<model identity>/<xx>/<block hash>.kvb``: the identity digest covers the checkpoint, dtype,
KV dtype, block size and the backend's block layout, so an engine only ever finds blocks it can load. A file is a
header (JSON: block hash, token ids, layout, payload length, blake2b checksum) and the block's bytes; it is written to
a temporary name and renamed, so a reader sees a whole file or none. A file that does not verify (corrupted,
truncated, another layout) is a miss and is deleted, never loaded. The folder is bounded: past ``max_bytes`` the
least recently used files (mtime, refreshed on every read) are deleted. A full disk (ENOSPC), an unwritable folder or
a bound of 0 turns the tier off with one warning: the engine runs on without it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import uuid
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

MAGIC = b"PKVB1\n"
SUFFIX = ".kvb"
#: A file being written (renamed to its ``SUFFIX`` name when whole); one a killed writer left stays behind.
TMP_SUFFIX = ".tmp"


def layout_signature(tensors: Sequence[torch.Tensor]) -> list[list]:
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]


class DiskStore:
    """Files of one model identity; ``read`` fills a one-block staging cache, ``write`` reads one."""

    def __init__(self, root: str, identity: str, max_bytes: int, layout: Optional[list] = None,
                 quiet: bool = False):
        self.dir = os.path.join(root, hashlib.sha256(identity.encode()).hexdigest()[:32])
        self.identity = identity
        self.max_bytes = max_bytes
        self.layout = layout
        self.enabled = True
        self.quiet = quiet  # (a scheduler-side index: the writer warns)
        self.used_bytes: Optional[int] = None  # scanned lazily by the writer
        if max_bytes <= 0:
            self.disable("its size bound is 0 bytes")
            return
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            self.disable(f"cannot create {self.dir}: {e}")

    def disable(self, why: str) -> None:
        if self.enabled and not self.quiet:
            logger.warning("KV offload disk tier off (%s); the host tier and recompute serve instead", why)
        self.enabled = False

    def path(self, block_hash: bytes) -> str:
        h = block_hash.hex()
        return os.path.join(self.dir, h[:2], h + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return self.enabled and os.path.exists(self.path(block_hash))

    # ---- write ---------------------------------------------------------------------------------------------
    def write(self, block_hash: bytes, token_ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> int:
        """Store one block atomically; returns the bytes written (0: not written, the tier may have turned off)."""
        if not self.enabled:
            return 0
        path = self.path(block_hash)
        if os.path.exists(path):
            return 0
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
        header = json.dumps({"hash": block_hash.hex(), "tokens": list(token_ids), "identity": self.identity,
                             "layout": layout_signature(tensors), "payload_len": len(payload),
                             "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
        data = MAGIC + struct.pack("<I", len(header)) + header + payload
        self._make_room(len(data))
        tmp = os.path.join(os.path.dirname(path), f".{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self.disable("the disk is full (ENOSPC)" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                         else f"writing {path} failed: {e}")
            return 0
        if self.used_bytes is not None:
            self.used_bytes += len(data)
        return len(data)

    def _files(self) -> list[os.DirEntry]:
        out = []
        for sub in os.scandir(self.dir):
            if sub.is_dir():
                out.extend(e for e in os.scandir(sub.path) if e.name.endswith(SUFFIX))
        return out

    def _make_room(self, need: int) -> None:
        """Delete least recently used files until ``need`` more bytes fit under the bound (rescanning the folder,
        which another engine may share, whenever the running total says it is over)."""
        if self.used_bytes is not None and self.used_bytes + need <= self.max_bytes:
            return
        files = []
        for e in self._files():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        files.sort()
        target = max(0, int(self.max_bytes * 0.9) - need)  # a little slack: not a rescan per write
        while files and total > target:
            _, size, p = files.pop(0)
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            total -= size
        self.used_bytes = total

    # ---- read ----------------------------------------------------------------------------------------------
    def read(self, block_hash: bytes, token_ids: Sequence[int], out: Sequence[torch.Tensor]) -> int:
        """Fill ``out`` (a one-block staging cache) with the stored block; returns the file's size, or 0 for a miss.
        A file that does not verify is deleted."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return 0
        try:
            self._decode(data, block_hash, token_ids, out)
        except ValueError as e:
            logger.warning("KV offload: dropping %s (%s)", path, e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return 0
        try:
            os.utime(path)  # recently used: last to be deleted by the bound
        except OSError:
            pass
        return len(data)

    def _decode(self, data: bytes, block_hash: bytes, token_ids: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            raise ValueError("not a KV block file")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        try:
            header = json.loads(data[start:start + hlen])
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("unreadable header") from None
        payload = data[start + hlen:]
        if header.get("hash") != block_hash.hex() or header.get("identity") != self.identity:
            raise ValueError("another block or model")
        if header.get("tokens") != list(token_ids):
            raise ValueError("other tokens")
        if header.get("layout") != layout_signature(out):
            raise ValueError("another KV layout")
        if header.get("payload_len") != len(payload):
            raise ValueError(f"truncated ({len(payload)} of {header.get('payload_len')} bytes)")
        if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
            raise ValueError("checksum mismatch")
        off = 0
        for t in out:
            n = t.numel() * t.element_size()
            src = torch.frombuffer(bytearray(payload[off:off + n]), dtype=torch.uint8)
            t.copy_(src.view(t.dtype).view(t.shape))
            off += n
