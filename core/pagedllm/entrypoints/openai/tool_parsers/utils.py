"""Reading JSON that is still being generated: the settled part of a value in canonical form, and the members of
an object seen so far. Streaming parsers send a call's arguments as prefixes of their final text, which is
``json.dumps(value, ensure_ascii=False)``; that form is a function of the value's tokens one by one, so the settled
tokens of a partial value give a prefix that only ever grows and ends as the final text."""

from __future__ import annotations

import json
import re
from typing import Any, Optional

_TOKEN = re.compile(r'\s*(?:(?P<p>[{}\[\],:])|(?P<s>"(?:[^"\\]|\\.)*")'
                    r'|(?P<n>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)(?![\d.eE+-])|(?P<l>true|false|null)\b)')
_SEPARATORS = {",": ", ", ":": ": "}


def _tokens(raw: str, pos: int):
    """(kind, text, end) of each settled JSON token from raw[pos]; stops where the text is incomplete or invalid
    (a number is settled only once a character after it shows it ended)."""
    i = pos
    while True:
        m = _TOKEN.match(raw, i)
        if m is None or (m.lastgroup == "n" and m.end() == len(raw)):
            return
        yield m.lastgroup, m.group(m.lastgroup), m.end()
        i = m.end()


def json_prefix(raw: str, pos: int = 0) -> tuple[str, Optional[int]]:
    """The canonical text of the JSON value at raw[pos] as far as raw settles it, and the index just after the
    value once it is complete (else None)."""
    out: list[str] = []
    depth = 0
    for kind, tok, end in _tokens(raw, pos):
        if kind == "p":
            if tok in "{[":
                depth += 1
            elif tok in "}]":
                if depth == 0:
                    break
                depth -= 1
            out.append(_SEPARATORS.get(tok, tok))
        else:
            try:
                out.append(json.dumps(json.loads(tok), ensure_ascii=False))
            except ValueError:  # e.g. a raw control character inside a string
                break
        if depth == 0:
            return "".join(out), end
    return "".join(out), None


def object_members(raw: str, pos: int = 0) -> tuple[dict[str, int], Optional[int]]:
    """The top-level members of the JSON object at raw[pos] seen so far (key -> index where its value starts) and
    the index just after the object once it is complete. Keys inside nested values are not members."""
    members: dict[str, int] = {}
    depth, key, expect_key = 0, None, False
    for kind, tok, end in _tokens(raw, pos):
        if kind == "p" and tok in "{[":
            if depth == 0 and tok != "{":
                break
            depth += 1
            expect_key = depth == 1
        elif kind == "p" and tok in "}]":
            depth -= 1
            if depth == 0:
                return members, end
        elif depth == 1:
            if tok == ",":
                expect_key = True
            elif kind == "s" and expect_key:
                key, expect_key = json.loads(tok), False
            elif tok == ":" and key is not None:
                members[key] = end
        if depth == 0:
            break
    return members, None


def partial_json_call(raw: str, pos: int, arg_keys: tuple[str, ...] = ("arguments",)
                      ) -> tuple[Optional[str], str, Optional[int]]:
    """(name, arguments so far, end) of a ``{"name": ..., "arguments": {...}}`` object at raw[pos]: the name once
    its string is complete, the canonical prefix of the first of ``arg_keys`` present, the end once the object is
    complete. The name is None (nothing to stream yet) while it is unknown or not a string."""
    members, end = object_members(raw, pos)
    name = None
    if "name" in members:
        text, done = json_prefix(raw, members["name"])
        if done is not None:
            value = json.loads(text)
            name = value if isinstance(value, str) else None
    key = next((k for k in arg_keys if k in members), None)
    args = json_prefix(raw, members[key])[0] if key is not None else ""
    return name, args, end


def dict_prefix(items: dict[str, Any]) -> str:
    """The canonical text of a dict whose members so far are ``items`` and whose end is not yet seen."""
    return json.dumps(items, ensure_ascii=False)[:-1]


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that may be the start of ``marker`` (held back from content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def content_end(text: str, *markers: str) -> int:
    """How much of ``text`` is content for sure: up to the first marker, less any tail that may begin one."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    return len(text) - max(held_suffix(text, m) for m in markers)
