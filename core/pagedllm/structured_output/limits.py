"""Limits on a request's grammar, set by the deployer (``--structured-outputs-config`` or one flag each).

Why: a grammar is user input whose compile cost grows with its size (100,000 choices or a JSON schema with 20,000
properties take tens of seconds and gigabytes), and a deeply nested schema overflows Python's recursion while it is
pickled to the engine. The size checks here run before any parse, iteratively (no recursion), so an oversized spec
is a 400 naming the limit and its flag before it costs anything; compile time is bounded by the compile pool
(``compile_pool.py``), which runs grammars apart from the engine's step loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Union

from pagedllm.errors import ParamError
from pagedllm.json_args import json_object
from pagedllm.reasoning import ReasoningParserManager
from pagedllm.sampling_params import StructuredOutputsParams


class GrammarLimitError(ParamError):
    """A grammar over one of the deployer's limits (HTTP 400; the message names the limit and its flag)."""


@dataclass
class StructuredOutputsConfig:
    """Grammar limits and the compile pool (``--structured-outputs-config``; the backend is its own flag,
    ``--structured-outputs-backend``).

    Every limit has its own flag ``--structured-outputs-<key with dashes>``."""

    compile_timeout: float = 10.0  # seconds one grammar may compile (queueing for a worker included)
    compile_workers: int = 2  # processes compiling grammars for the server (each ~150 MB)
    max_choices: int = 4096  # strings in a ``choice`` list
    max_grammar_chars: int = 131072  # characters of a regex, grammar, JSON schema (as JSON) or all choices together
    max_schema_properties: int = 1024  # properties over a whole JSON schema (xgrammar: ~2 s at 1024 optional ones)
    max_schema_depth: int = 64  # nesting of the JSON schema document (objects and arrays)
    cache_bytes: int = 128 << 20  # compiled grammars kept (by their size), in the server and in the engine
    worker_memory_bytes: int = 1 << 30  # a compile worker that grew by more than this (resident) is replaced
    # vLLM's reasoning keys (not limits; serve's --reasoning-parser sets the first): with a reasoning parser, a
    # request's grammar applies from the end of its reasoning (docs/reasoning.md), or all along when
    # enable_in_reasoning.
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.reasoning_parser, str):
            raise ParamError("structured_outputs_config.reasoning_parser", f"must be a parser name, got "
                                                                         f"{self.reasoning_parser!r}")
        if self.reasoning_parser:
            known = ReasoningParserManager.list_registered()
            if self.reasoning_parser not in known:
                raise ParamError("reasoning_parser", f"unknown reasoning parser {self.reasoning_parser!r}; known: "
                                                     f"{', '.join(known)}")
        if not isinstance(self.enable_in_reasoning, bool):
            raise ParamError("structured_outputs_config.enable_in_reasoning", f"must be true or false, got "
                                                                            f"{self.enable_in_reasoning!r}")
        for f in limit_fields():
            v = getattr(self, f.name)
            kind = float if f.name == "compile_timeout" else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                    or v <= 0:
                raise ParamError(f"structured_outputs_config.{f.name}", f"must be a positive {kind.__name__}, "
                                                                       f"got {v!r}")

    @classmethod
    def parse(cls, value: Union[None, str, dict, "StructuredOutputsConfig"]) -> "StructuredOutputsConfig":
        """From a dict or JSON text (``--structured-outputs-config``); None gives the defaults."""
        if isinstance(value, StructuredOutputsConfig):
            return value
        if value is None:
            return cls()
        return cls(**json_object(value, "structured_outputs_config", (f.name for f in fields(cls))))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def limit_fields() -> tuple:
    """The fields of :class:`StructuredOutputsConfig` that are limits (each has its own flag)."""
    return tuple(f for f in fields(StructuredOutputsConfig) if f.name not in ("reasoning_parser",
                                                                              "enable_in_reasoning"))


def flag(key: str) -> str:
    return "--structured-outputs-" + key.replace("_", "-")


def _over(field: str, what: str, n: int, key: str, limit: int) -> GrammarLimitError:
    return GrammarLimitError(field, f"{what} {n} exceeds this server's limit of {limit} ({flag(key)})")


def check_spec(spec: StructuredOutputsParams, cfg: StructuredOutputsConfig) -> None:
    """Raise :class:`GrammarLimitError` (field ``structured_outputs.<kind>``) if ``spec`` is over a limit.

    Linear in the spec's size and never recursive, so it is safe on hostile input of any shape."""
    kind = spec.kind
    field = f"structured_outputs.{kind}"
    if kind == "choice":
        if len(spec.choice) > cfg.max_choices:
            raise _over(field, "the number of choices", len(spec.choice), "max_choices", cfg.max_choices)
        size = sum(len(c) for c in spec.choice)
        if size > cfg.max_grammar_chars:
            raise _over(field, "the total length of the choices (characters)", size, "max_grammar_chars",
                        cfg.max_grammar_chars)
    elif kind in ("regex", "grammar"):
        text = getattr(spec, kind)
        if len(text) > cfg.max_grammar_chars:
            raise _over(field, f"the {kind}'s length (characters)", len(text), "max_grammar_chars",
                        cfg.max_grammar_chars)
    elif kind == "json":
        _check_schema(spec.json, cfg, field)


def _check_schema(schema: Any, cfg: StructuredOutputsConfig, field: str) -> None:
    """Depth, property count and size of a JSON schema, walked with an explicit stack (depth first checked, so a
    too-deep document is refused before anything serialises it)."""
    props = 0
    chars = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > cfg.max_schema_depth:
                raise _over(field, "the schema's nesting depth", depth, "max_schema_depth", cfg.max_schema_depth)
            p = node.get("properties")
            if isinstance(p, dict):
                props += len(p)
                if props > cfg.max_schema_properties:
                    raise GrammarLimitError(field, f"the schema has more than {cfg.max_schema_properties} properties "
                                                   f"(this server's limit, {flag('max_schema_properties')})")
            for k, v in node.items():
                chars += len(k) + 4 if isinstance(k, str) else 8
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            if depth > cfg.max_schema_depth:
                raise _over(field, "the schema's nesting depth", depth, "max_schema_depth", cfg.max_schema_depth)
            chars += 2
            stack.extend((v, depth + 1) for v in node)
        else:
            chars += len(node) + 2 if isinstance(node, str) else 8
        if chars > cfg.max_grammar_chars:
            raise GrammarLimitError(field, f"the schema is longer than {cfg.max_grammar_chars} characters (this "
                                           f"server's limit, {flag('max_grammar_chars')})")

