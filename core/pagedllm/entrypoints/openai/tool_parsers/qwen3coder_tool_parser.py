"""``qwen3_coder``: Qwen3-Coder's XML calls,
``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`` (the ``<tool_call>`` wrapper
may be missing). Parameter values are text; each is converted by the type its tool's JSON schema gives it, as vLLM
does (integer, number, boolean, object/array as JSON, anything else through ``ast.literal_eval``; a value that does
not convert stays text; ``null`` is None)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import ExtractedToolCallInformation
from pagedllm.entrypoints.openai.tool_parsers.utils import content_end, dict_prefix

_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INT = ("int", "uint", "long", "short", "unsigned")


def _field(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _tool_properties(name: str, request: Any) -> dict:
    """The ``properties`` of function ``name`` in the request's tools ({} when unknown). Tools may be chat-style
    (``{"type": "function", "function": {...}}``) or flat as in the Responses API, models or dicts."""
    for tool in _field(request, "tools") or []:
        fn = _field(tool, "function") or tool
        params = _field(fn, "parameters")
        if _field(fn, "name") == name and isinstance(params, dict):
            return params.get("properties", params)
    return {}


def convert_param_value(value: str, name: str, properties: dict) -> Any:
    """vLLM's conversion of one parameter's text by its schema type."""
    if value.lower() == "null":
        return None
    if name not in properties:
        return value
    spec = properties[name]
    kind = str(spec["type"]).strip().lower() if isinstance(spec, dict) and "type" in spec else "string"
    if kind in _STRING:
        return value
    if kind.startswith(_INT):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            f = float(value)
        except ValueError:
            return value
        return f if f - int(f) != 0 else int(f)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


@ToolParserManager.register_module("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_prefix = "<function="
    function_end_token = "</function>"
    parameter_end_token = "</parameter>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.S)
    tool_call_function_regex = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.S)
    tool_call_parameter_regex = re.compile(
        r"<parameter=(.*?)(</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)
    call_format = ("write each call as <tool_call>\n<function=NAME>\n<parameter=PARAM>\nVALUE\n</parameter>\n"
                   "</function>\n</tool_call>")

    def _params(self, fn_name: str, body: str, request: Any, complete: bool) -> dict[str, Any]:
        """The parameters in ``body``; with ``complete`` False, only those whose end is already written."""
        properties = _tool_properties(fn_name, request)
        params: dict[str, Any] = {}
        for m in self.tool_call_parameter_regex.finditer(body):
            if not complete and not m.group(2) and not body.startswith(("<parameter=", "</function>"), m.end()):
                break  # still being written
            text = m.group(1)
            idx = text.index(">")
            name, value = text[:idx], text[idx + 1:]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            params[name] = convert_param_value(value, name, properties)
        return params

    def _function_calls(self, model_output: str) -> list[tuple[str, bool]]:
        """Each function's text after ``<function=`` and whether its ``</function>`` is written."""
        raw = [a or b for a, b in self.tool_call_regex.findall(model_output)] or [model_output]
        return [(m.group(1) if m.group(1) is not None else m.group(2), m.group(1) is not None)
                for call in raw for m in self.tool_call_function_regex.finditer(call)]

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        not_calls = ExtractedToolCallInformation(tools_called=False, content=model_output)
        if self.tool_call_prefix not in model_output:
            return not_calls
        try:
            calls = []
            for fn, _ in self._function_calls(model_output):
                head = fn.index(">")
                params = self._params(fn[:head], fn[head + 1:], request, complete=True)
                calls.append(self.tool_call(fn[:head], json.dumps(params, ensure_ascii=False)))
        except ValueError:  # a name or parameter without its ">"
            return not_calls
        if not calls:
            return not_calls
        start = model_output.find(self.tool_call_start_token)
        content = model_output[:start if start >= 0 else model_output.find(self.tool_call_prefix)]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def stream_view(self, text: str, request: Any) -> tuple[int, list[StreamedCall]]:
        calls: list[StreamedCall] = []
        try:
            for fn, complete in self._function_calls(text):
                head = fn.find(">")
                if head < 0:
                    break
                params = self._params(fn[:head], fn[head + 1:], request, complete)
                calls.append(StreamedCall(fn[:head], json.dumps(params, ensure_ascii=False) if complete
                                          else dict_prefix(params)))
        except ValueError:  # a parameter without its ">": the final parse decides
            pass
        return content_end(text, self.tool_call_start_token, self.tool_call_prefix), calls
