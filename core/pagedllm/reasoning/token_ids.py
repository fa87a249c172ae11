"""Token-sequence helpers shared by the parsers: a tag is one added token in real reasoning models, several
tokens where a tokenizer lacks it, so tags are matched as id sequences."""

from __future__ import annotations

from typing import Any, Sequence


def tag_ids(tokenizer: Any, tag: str) -> list[int]:
    """The ids ``tag`` encodes to (one id when it is an added token)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes {tag!r} to no tokens")
    return [int(t) for t in ids]


def rfind_seq(ids: Sequence[int], seq: Sequence[int], start: int = 0) -> int:
    """Index of the last occurrence of ``seq`` in ``ids[start:]`` (-1 if none)."""
    n = len(seq)
    first = seq[0]
    for i in range(len(ids) - n, start - 1, -1):
        if ids[i] == first and (n == 1 or list(ids[i:i + n]) == list(seq)):
            return i
    return -1
