"""llguidance (``--structured-outputs-backend guidance``): Earley-based, no grammar compile step to speak of."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance  # heavy: llguidance.hf imports transformers
        import llguidance.hf  # heavy: llguidance.hf imports transformers
        import llguidance.torch  # heavy: llguidance.hf imports transformers

        self.llg = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids[0]
                                                      if stop_token_ids else None)
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)

    def parse(self, spec: StructuredOutputsParams) -> str:
        M = self.llg.LLMatcher
        kind = spec.kind
        try:
            if kind == "json":
                schema = _closed(spec.json) if isinstance(spec.json, dict) else {}
                grammar = M.grammar_from_json_schema(json.dumps(schema),
                                                     defaults={"whitespace_flexible": False})
            elif kind == "json_object":
                grammar = M.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = M.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = M.grammar_from_regex("|".join(_escape(c) for c in spec.choice))
            else:
                text = spec.grammar
                if "::=" in text:
                    from llguidance.gbnf_to_lark import any_to_lark  # heavy: llguidance, only for GBNF

                    text = any_to_lark(text)
                grammar = M.grammar_from_lark(text)
            err = M.validate_grammar(grammar, self.tokenizer)
        except Exception as e:  # noqa: BLE001 - the libraries raise plain Exception for bad grammars
            err = str(e)
        if err:
            raise ParamError(f"structured_outputs.{kind}", f"cannot be compiled: {err.strip()}")
        return grammar

    def compile(self, grammar: str) -> "GuidanceGrammar":
        """The grammar's first matcher: llguidance builds its lexer here (1.5 s for a schema of 2,000 properties,
        with the GIL released), in the grammar thread or a compile worker; each request gets a copy of it, so the
        engine's step loop never builds one."""
        first = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if first.is_error():
            raise ParamError("structured_outputs", f"cannot be compiled: {first.get_error()}")
        return GuidanceGrammar(grammar, first)

    def serialize(self, compiled: "GuidanceGrammar") -> str:
        return compiled.text

    def load(self, payload: str) -> "GuidanceGrammar":
        return self.compile(payload)

    @staticmethod
    def size(compiled: "GuidanceGrammar") -> int:
        return 64 * len(compiled.text)  # llguidance does not report its matcher's size: a rough multiple

    def matcher(self, compiled: "GuidanceGrammar", json_output: bool = False) -> "GuidanceMatcher":
        return GuidanceMatcher(compiled.first.deep_copy(), self.fill_fn, self.stop_token_ids)


@dataclass
class GuidanceGrammar:
    text: str  # the llguidance grammar (what a compile worker sends the engine)
    first: Any  # a matcher in its start state, copied for every request

    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32


class GuidanceMatcher:
    """As vLLM's guidance backend: the request ends when a stop token is accepted, like xgrammar's matcher. Once the
    grammar is complete llguidance reports ``is_stopped`` and its mask allows only the stop token, so the output
    still ends with EOS instead of stopping one token early."""

    def __init__(self, m: Any, fill_fn: Any, stop_token_ids: frozenset):
        self.m, self.fill_fn, self.stop_token_ids = m, fill_fn, stop_token_ids
        self.terminated = False

    def accept(self, token: int) -> bool:
        if self.m.is_stopped():
            ok = token in self.stop_token_ids
        else:
            ok = self.m.consume_token(token)
        self.terminated = ok and (token in self.stop_token_ids or self.terminated)
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.fill_fn(self.m, bitmask, row)

    def is_terminated(self) -> bool:
        return self.terminated


def _escape(s: str) -> str:
    return re.escape(s)


def _closed(schema: Any) -> Any:
    """``additionalProperties: false`` wherever a schema leaves it unset, as xgrammar's strict mode does (and vLLM
    does for llguidance), so both backends produce the same objects."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
