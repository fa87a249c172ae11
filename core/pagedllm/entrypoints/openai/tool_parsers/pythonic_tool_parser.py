"""``pythonic``: calls written as a Python list, ``[get_weather(city='SF'), f(x=1)]`` (Llama 3.2/4, ToolACE). The
list is read with ``ast`` (never evaluated): every element must be a call of a plain name with keyword arguments
whose values are literals (strings, numbers, booleans, None, lists, tuples, dicts), else the output is content.
As in vLLM, the whole output must be the list."""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import dict_prefix

_CALL_NAME = re.compile(r"[\s,]*([A-Za-z_]\w*)\s*\(")


class _NotACall(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotACall("tool call arguments must be literals")


def _call(node: ast.expr) -> tuple[str, dict]:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
            or any(k.arg is None for k in node.keywords):
        raise _NotACall("each element must be name(keyword=literal, ...)")
    return node.func.id, {k.arg: _literal(k.value) for k in node.keywords}


def _parse(source: str) -> ast.expr:
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise _NotACall(str(e)) from None


def _string_end(text: str, i: int) -> int:
    """Index after the Python string literal whose quote is at text[i], or -1 while it is unterminated."""
    quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
    j = i + len(quote)
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith(quote, j):
            return j + len(quote)
        elif len(quote) == 1 and text[j] == "\n":
            return -1
        else:
            j += 1
    return -1


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    call_format = "respond with a Python list of calls: [func_name(param=value, ...), ...]"

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        source = model_output.strip()
        try:
            if not source.startswith("["):
                raise _NotACall("not a list")
            body = _parse(source)
            if not isinstance(body, ast.List) or not body.elts:
                raise _NotACall("not a list of calls")
            found = [_call(e) for e in body.elts]
        except _NotACall:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = [self.tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in found]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=None)

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return 0, []
        if text[start] != "[":
            return len(text), []
        calls: list[StreamedCall] = []
        call_start, commas, depth, i = start + 1, [], 1, start + 1
        while i < len(text) and depth > 0:
            ch = text[i]
            if ch in "'\"":
                end = _string_end(text, i)
                if end < 0:
                    break
                i = end
                continue
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
                if depth == 1 and ch == ")":  # a call is complete
                    try:
                        name, args = _call(_parse(text[call_start:i + 1].lstrip(" \n\t\r,")))
                    except _NotACall:
                        return 0, calls
                    calls.append(StreamedCall(name, json.dumps(args, ensure_ascii=False)))
                    call_start, commas = i + 1, []
            elif ch == "," and depth == 2:
                commas.append(i)
            i += 1
        if depth > 1:
            calls.append(self._partial_call(text[call_start:], [c - call_start for c in commas]))
        return 0, calls

    @staticmethod
    def _partial_call(text: str, commas: list[int]) -> StreamedCall:
        """A call still being written: its name once ``(`` follows it, and the keyword arguments before its last
        top-level comma."""
        m = _CALL_NAME.match(text)
        if m is None:
            return StreamedCall(None)
        args: Optional[dict] = {}
        if commas:
            try:
                args = _call(_parse(text[m.start(1):commas[-1]] + ")"))[1]
            except _NotACall:
                args = None
        return StreamedCall(m.group(1), dict_prefix(args) if args is not None else "")
