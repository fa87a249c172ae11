"""Tool calling for chat: rendering tools into the prompt, grammars for forced choices, parsing calls out of text.

``tool_choice``: ``none`` (tools are not rendered, output is plain text), ``auto`` (needs ``--enable-auto-tool-choice``
and ``--tool-call-parser``; the parser finds calls in free text), ``required`` (the output is constrained to a JSON
array of ``{"name", "parameters"}`` objects, one schema branch per tool) and a named function (the output is
constrained to that function's parameters schema). Forced choices are enforced by a grammar, as vLLM does, so every
response carries valid calls whatever the model. The ``auto`` parsers live in ``tool_parsers/`` (vLLM's
``ToolParser`` interface, ``ToolParserManager`` registry); this module holds what serving needs of them.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.records import make_tool_call_id
from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams

Call = tuple[str, str]  # (function name, arguments as JSON text)


def call_id() -> str:
    return make_tool_call_id()


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
    """The system message used when the chat template does not render ``tools`` (e.g. SmolLM2's): the functions
    and the call format of ``parser`` (hermes's when there is none)."""
    sigs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    fmt = ToolParserManager.get_tool_parser(parser or "hermes").call_format
    return f"You may call these functions:\n{sigs}\nTo call a function, {fmt}."


def tool_parser_names() -> list[str]:
    """The registered ``--tool-call-parser`` names."""
    return ToolParserManager.list_registered()


def new_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """A parser for one choice (streaming keeps its state on the instance)."""
    return ToolParserManager.get_tool_parser(name)(tokenizer)


def delta_dicts(delta: Optional[DeltaMessage]) -> list[dict]:
    """A parser's streamed step as chunk deltas: its content, then its tool-call pieces."""
    if delta is None:
        return []
    out: list[dict] = []
    if delta.content:
        out.append({"content": delta.content})
    if delta.tool_calls:
        out.append({"tool_calls": [d.model_dump(exclude_none=True) for d in delta.tool_calls]})
    return out


def openai_calls(calls: list[Call]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
