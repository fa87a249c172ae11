"""Tool calling for chat: rendering tools into the prompt, grammars for forced choices, parsing calls out of text.

``tool_choice``: ``none`` (tools are not rendered, output is plain text), ``auto`` (needs ``--enable-auto-tool-choice``
and ``--tool-call-parser``; the parser finds calls in free text), ``required`` (the output is constrained to a JSON
array of ``{"name", "parameters"}`` objects, one schema branch per tool) and a named function (the output is
constrained to that function's parameters schema). Forced choices are enforced by a grammar, as vLLM does, so every
response carries valid calls whatever the model. Parsers: ``hermes`` (Hermes/Qwen ``<tool_call>{...}</tool_call>``)
and ``llama3_json`` (Llama 3's bare ``{"name": ..., "parameters": ...}``, ``;``-separated, optional
``<|python_tag|>``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams

PARSERS = ("hermes", "llama3_json")

Call = tuple[str, str]  # (function name, arguments as JSON text)


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _params_schema(fn: Any) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def forced_grammar(tools: list, choice: Any, parallel: Optional[bool]) -> Optional[StructuredOutputsParams]:
    """The grammar that enforces ``required`` or a named ``tool_choice`` (None for none/auto)."""
    if choice == "required":
        branches = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                      "parameters": _params_schema(t.function)},
                     "required": ["name", "parameters"]} for t in tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if parallel is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    if choice is not None and not isinstance(choice, str):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_params_schema(fn))
    return None


def forced_calls(text: str, choice: Any) -> list[Call]:
    """Calls from a forced-choice output (the grammar guarantees the shape unless the output was cut short)."""
    if not isinstance(choice, str):
        return [(choice.function.name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items
            if isinstance(it, dict) and "name" in it and "parameters" in it]


def check_request(tools: Optional[list], choice: Any, auto_enabled: bool, parser: Optional[str],
                  constrained: bool) -> Any:
    """Validate tools/tool_choice (ParamError naming the field); returns the effective choice."""
    if not tools:
        if choice not in (None, "none"):
            raise ParamError("tool_choice", "needs tools")
        return "none"
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are present
    if not isinstance(choice, str) and choice.function.name not in {t.function.name for t in tools}:
        raise ParamError("tool_choice", f"names function {choice.function.name!r}, which is not in tools")
    if choice == "auto" and not (auto_enabled and parser):
        raise ParamError("tool_choice", '"auto" needs the server started with --enable-auto-tool-choice and '
                                        '--tool-call-parser; use "required", a named function or "none"')
    if constrained and choice not in ("none", "auto"):
        raise ParamError("tool_choice", "cannot be combined with response_format / structured_outputs")
    for t in tools:
        p = t.function.parameters
        if p is not None and p.get("type", "object") != "object":
            raise ParamError("tools", f"function {t.function.name!r}: parameters must be an object schema")
    return choice


def tools_for_template(tools: list) -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in t.function.model_dump().items() if v is not None}}
            for t in tools]


def tools_system_prompt(tools: list[dict], parser: Optional[str]) -> str:
    """The system message used when the chat template does not render ``tools`` (e.g. SmolLM2's)."""
    sigs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    if parser == "llama3_json":
        fmt = 'respond with a JSON object {"name": <function name>, "parameters": <arguments object>}'
    else:
        fmt = 'wrap each call as <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>'
    return f"You may call these functions:\n{sigs}\nTo call a function, {fmt}."


# ---- parsers (auto) ------------------------------------------------------------------------------------------
class HermesParser:
    start = "<tool_call>"
    _re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[Optional[str], list[Call]]:
        if self.start not in text:
            return text, []
        calls = []
        for body in self._re.findall(text):
            try:
                obj = json.loads(body)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append((obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[:text.index(self.start)].strip()
        return content or None, calls

    def started(self, text: str) -> bool:
        return self.start in text

    def holds(self, text: str) -> int:
        """Index from which streamed text must be held back (a call, or what may become one), else len(text)."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return len(text) - n
        return len(text)


class Llama3JsonParser:
    tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[Optional[str], list[Call]]:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, []
            args = obj.get("parameters", obj.get("arguments", {}))
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def started(self, text: str) -> bool:
        s = text.lstrip()
        return s.startswith("{") or s.startswith(self.tag)

    def holds(self, text: str) -> int:
        s = text.lstrip()
        if s.startswith("{") or s.startswith(self.tag) or self.tag.startswith(s):
            return 0
        return len(text)


def get_parser(name: str) -> Any:
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()


def openai_calls(calls: list[Call]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
