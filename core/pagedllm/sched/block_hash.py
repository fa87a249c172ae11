"""The prefix cache's block key, in a module of its own (no torch) so that ``pagedllm router`` computes the same keys
as the replicas it routes to without loading the engine."""

from __future__ import annotations

import array
import hashlib
from typing import Optional, Sequence


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], extra: object = None) -> bytes:
    """Chained sha256 of one full block; ``extra`` covers anything else that changes its K/V (e.g. a LoRA id)."""
    h = hashlib.sha256(parent or b"")
    h.update(array.array("q", token_ids).tobytes())
    if extra is not None:
        h.update(repr(extra).encode())
    return h.digest()
