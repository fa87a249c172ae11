"""xgrammar (the default backend): grammars parsed at request time, compiled against the tokenizer in a thread."""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr  # heavy: xgrammar (seconds), on the first grammar

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler: Any = None
        self._no_control: Any = None

    @property
    def compiler(self) -> Any:
        """Made on first compile: it owns threads, and a compile worker is forked from a zygote that built this
        backend (``compile_worker.py``). No compiler cache: the manager and the compile pool keep compiled
        grammars, bounded by bytes."""
        if self._compiler is None:
            self._compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return self._compiler

    def parse(self, spec: StructuredOutputsParams) -> Any:
        """The grammar of ``spec`` (fast: no tokenizer work); a bad spec raises ParamError naming the problem."""
        G = self.xgr.Grammar
        kind = spec.kind
        try:
            if kind == "json":
                schema = spec.json if isinstance(spec.json, dict) else {}
                return G.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if kind == "json_object":  # any object (OpenAI's json_object), compact like the schemas
                return G.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return G.from_regex(spec.regex)
            if kind == "choice":
                return G.from_ebnf(choice_ebnf(spec.choice))
            text = spec.grammar
            return G.from_ebnf(text) if "::=" in text else G.from_lark(text)
        except Exception as e:  # noqa: BLE001 - the libraries raise plain Exception for bad grammars
            raise ParamError(f"structured_outputs.{kind}", f"cannot be compiled: {_first_line(e)}") from None

    def compile(self, grammar: Any) -> Any:
        return self.compiler.compile_grammar(grammar)

    def serialize(self, compiled: Any) -> str:
        """The compiled grammar as text, to ship from a compile worker to the engine (xgrammar's own format)."""
        return compiled.serialize_json()

    def load(self, payload: str) -> Any:
        """A compiled grammar from :meth:`serialize`; raises if it was compiled for another tokenizer."""
        return self.xgr.CompiledGrammar.deserialize_json(payload, self.info)

    @staticmethod
    def size(compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def matcher(self, compiled: Any, json_output: bool = False) -> "XgrammarMatcher":
        return XgrammarMatcher(self.xgr.GrammarMatcher(compiled), self.no_control_mask() if json_output else None)

    def no_control_mask(self) -> torch.Tensor:
        """Bitmask row allowing every token except those holding a raw control byte (0x00-0x1f).

        xgrammar 0.2.9's rule for length-bounded JSON strings (``maxLength``) admits raw control characters, which
        strict JSON forbids; our JSON grammars are compact (no whitespace between tokens), so no valid output holds
        one and AND-ing this row into the mask is exact."""
        if self._no_control is None:
            words = self.bitmask_words()
            allowed = torch.ones(words * 32, dtype=torch.bool)
            for i, tok in enumerate(self.info.decoded_vocab):
                if any(b < 0x20 for b in tok):
                    allowed[i] = False
            bits = allowed.view(words, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
            packed = bits.sum(dim=1)
            self._no_control = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        return self._no_control

    def bitmask_words(self) -> int:
        return (self.info.vocab_size + 31) // 32


class XgrammarMatcher:
    def __init__(self, m: Any, and_mask: Any = None):
        self.m = m
        self.and_mask = and_mask

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        if self.and_mask is not None:
            bitmask[row] &= self.and_mask

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = text[-1] if text else type(e).__name__
    return msg.split("] ", 1)[-1] if msg.startswith("[") else msg
