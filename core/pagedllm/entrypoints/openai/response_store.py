"""The in-memory store behind ``store`` / ``previous_response_id`` / ``GET`` and ``DELETE /v1/responses/{id}``.

Bounded, unlike vLLM's (which never forgets and warns about the leak): least recently used entries are evicted once
the store holds more than ``max_items`` responses or more than ``max_bytes`` of them (each entry's size is the
length of its JSON: the response and the conversation that led to it). An entry larger than ``max_bytes`` on its
own is not kept. A later request naming an evicted id gets the same 404 as an unknown one.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class StoredResponse:
    """A finished response and the chat messages that produced it (what ``previous_response_id`` continues)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int


class ResponseStore:
    """LRU by count and bytes; single-threaded (the server's event loop), so no lock is needed."""

    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_items < 0 or max_bytes < 0:
            raise ValueError("response store bounds must be >= 0")
        self.max_items, self.max_bytes = max_items, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its ``id``); False when it alone exceeds the bounds and was not kept."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        rid = response["id"]
        self.delete(rid)
        if self.max_items == 0 or size > self.max_bytes:
            logger.info("response %s (%d bytes) not stored: over --max-stored-responses-mb", rid, size)
            return False
        self._entries[rid] = StoredResponse(response, messages, size)
        self.bytes += size
        while len(self._entries) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
