"""vLLM's ``ReasoningParser`` interface and ``ReasoningParserManager`` registry (``--reasoning-parser NAME``).

A parser splits a reasoning model's output into the reasoning (``reasoning_content`` / ``reasoning`` in chat
responses) and the answer (``content``). The engine asks it one question, ``is_reasoning_end``, to know when a
request's grammar starts to apply (``structured_output/manager.py``); the server asks it for the split, whole
(``extract_reasoning``) or per stream delta (``extract_reasoning_streaming``).

pagedllm's parsers are built on one text split, ``split(text, final)``, that is monotone: the split of a prefix of an
output is a prefix of the split of the output, field by field (text that may still become a tag, such as a trailing
``</thi``, is held back until it is decided). Streaming is then the difference of two splits, so the concatenated
deltas equal the whole split exactly, a tag cut across deltas included (``streaming.ReasoningStream`` adds the
flush at the end of a stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Optional, Sequence

from pagedllm.parser_registry import ParserRegistry


@dataclass
class DeltaMessage:
    """One stream delta of a reasoning split (vLLM's ``DeltaMessage`` fields that reasoning sets)."""

    reasoning: Optional[str] = None
    content: Optional[str] = None

    @property
    def reasoning_content(self) -> Optional[str]:
        """vLLM's older name of ``reasoning`` (both are sent on the wire)."""
        return self.reasoning


def longest_partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers`` (0 if none): the part
    of a stream that may still turn into a marker and must not be emitted yet."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ReasoningParser:
    """Base class (vLLM's interface). Subclasses implement :meth:`split` and :meth:`is_reasoning_end`.

    ``kwargs`` may carry ``chat_template_kwargs`` (the request's; e.g. Qwen3's ``enable_thinking``), as in vLLM."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any):
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs: dict = dict(kwargs.get("chat_template_kwargs") or {})

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    # ---- the engine's question ------------------------------------------------------------------------------
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True when the reasoning has ended in ``input_ids`` (prompt and output so far)."""
        raise NotImplementedError

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        """True when the reasoning ends with ``delta_ids``, the last tokens of ``input_ids`` (a decode step)."""
        return self.is_reasoning_end(input_ids)

    def prompt_is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """True when the prompt itself closes the reasoning of the turn it opens (Qwen3's template with
        ``enable_thinking=False`` ends the prompt with an empty think block): the output is then all answer, and
        a grammar applies from its first token. An earlier turn's closed reasoning does not count."""
        return self.is_reasoning_end(prompt_token_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The output's token ids after the reasoning ([] while it is not over)."""
        raise NotImplementedError

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Output tokens that belong to the reasoning (0 where the parser cannot tell, as vLLM's default)."""
        return 0

    # ---- the server's split -----------------------------------------------------------------------------------
    def adjust_request(self, request: Any) -> Any:
        """Change the request before it runs (e.g. keep special tokens in the text when the tags are special
        tokens); returns it."""
        return request

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; unless ``final``, text that may still become a tag is held back."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output; a part that is empty is None."""
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> Optional[DeltaMessage]:
        """The delta that ``delta_text`` adds (None when it adds nothing visible yet)."""
        r0, c0 = self._split_cached(previous_text)
        r1, c1 = self._split_cached(current_text)
        dr, dc = r1[len(r0):], c1[len(c0):]
        if not dr and not dc:
            return None
        return DeltaMessage(reasoning=dr or None, content=dc or None)

    def _split_cached(self, text: str) -> tuple[str, str]:
        cache = self.__dict__.setdefault("_last_splits", {})
        hit = cache.get(text)
        if hit is None:
            hit = self.split(text, final=False)
            if len(cache) >= 2:  # a stream asks for the previous text, then the current one
                cache.pop(next(iter(cache)))
            cache[text] = hit
        return hit


class ReasoningParserManager(ParserRegistry):
    """The registry of reasoning parsers by name (vLLM's, ``--reasoning-parser``)."""

    kind, base = "reasoning parser", ReasoningParser
    reasoning_parsers = parsers = {}
    lazy_parsers = {}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.get(name)


def get_reasoning_parser(name: str, tokenizer: Any, **kwargs: Any) -> ReasoningParser:
    """An instance of the parser registered as ``name`` (convenience over the manager)."""
    return ReasoningParserManager.get_reasoning_parser(name)(tokenizer, **kwargs)

