"""Processor tensors handed from the server's render workers to the engine process through shared memory.

An image's pixel values are megabytes (SmolVLM's tiles of one image: ~50 MB in float32); pickled by value they
would be copied through two pipes (render worker -> HTTP process -> engine). Instead the render worker writes each
tensor once into a POSIX shared-memory segment and sends a :class:`SharedTensor` handle (name, shape, dtype: a few
bytes); the engine copies it out once and unlinks the segment.

Ownership is handed on with the handle: the worker stops tracking what it created (its exit must not unlink a
segment the engine has not read yet); the engine unlinks what it loads; whoever drops a prompt before the engine
took it (a 400 after processing, a client gone) calls :func:`release_features`. Unlinking twice is harmless, so both
sides may release on a race. Segment names start with :data:`SEGMENT_PREFIX`, so a leak is visible under /dev/shm.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Sequence

import torch

from pagedllm.errors import ParamError

SEGMENT_PREFIX = "pagedllm_mm_"


@dataclass(frozen=True)
class SharedTensor:
    """A contiguous tensor in the shared-memory segment ``name`` (until the engine loads or someone releases it)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    def load(self) -> torch.Tensor:
        """The tensor (a private copy); the segment is unlinked."""
        try:
            shm = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            raise ParamError("multi_modal_data", "the processed image data was released before the engine read it "
                                                 "(the request was cancelled)") from None
        try:
            out = torch.empty(self.shape, dtype=self.dtype)
            if self.nbytes:
                src = torch.frombuffer(shm.buf, dtype=torch.uint8, count=self.nbytes)
                out.view(-1).view(torch.uint8).copy_(src)
                del src  # the memoryview export must go before close()
        finally:
            shm.close()
            _unlink(shm)
        return out

    def release(self) -> None:
        """Unlink the segment without reading it (a prompt dropped before the engine took it)."""
        try:
            shm = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            return
        shm.close()
        _unlink(shm)


def _unlink(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.unlink()  # (also unregisters it from this process's resource tracker)
    except FileNotFoundError:
        pass


def new_tag() -> str:
    """A fresh tag for the segments of one job (``share(..., tag)``)."""
    return secrets.token_hex(8)


def share(tensor: torch.Tensor, tag: str) -> SharedTensor:
    """``tensor`` copied into a new segment (named for ``tag``) that this process no longer owns."""
    t = tensor.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    name = f"{SEGMENT_PREFIX}{tag}_{secrets.token_hex(6)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    try:
        if nbytes:
            dst = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            dst.copy_(t.reshape(-1).view(torch.uint8))
            del dst
    except BaseException:
        shm.close()
        _unlink(shm)
        raise
    shm.close()
    # Python < 3.13 has no track=False: without this, the worker's tracker would unlink it when the worker exits.
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the tracker's key is the raw name
    return SharedTensor(name, tuple(t.shape), t.dtype, nbytes)


def _map_data(features: Sequence[Any], fn) -> list[Any]:
    return [replace(f, data={k: fn(v) for k, v in f.data.items()}) for f in features]


def share_features(features: Sequence[Any], tag: str) -> list[Any]:
    """``MultiModalFeatureSpec`` list with every tensor in ``data`` moved to shared memory (segments named for
    ``tag``: whoever loses the handles can still find them)."""
    shared: list[SharedTensor] = []

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            shared.append(share(v, tag))
            return shared[-1]
        return v

    try:
        return _map_data(features, one)
    except BaseException:
        for s in shared:
            s.release()
        raise


def load_features(features: Sequence[Any]) -> list[Any]:
    """The features with their shared tensors read back (and unlinked); every segment is released, even when one
    fails to load."""
    try:
        return _map_data(features, lambda v: v.load() if isinstance(v, SharedTensor) else v)
    finally:
        release_features(features)


def release_features(features: Sequence[Any]) -> None:
    """Unlink every segment the features still hold (idempotent)."""
    for f in features:
        for v in f.data.values():
            if isinstance(v, SharedTensor):
                v.release()
