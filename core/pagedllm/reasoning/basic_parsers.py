"""``BaseThinkingReasoningParser``: reasoning between a start and an end tag (``<think>``...``</think>``)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, longest_partial_suffix
from pagedllm.reasoning.token_ids import rfind_seq, tag_ids


class BaseThinkingReasoningParser(ReasoningParser):
    """Reasoning is the text between ``start_token`` and ``end_token``; the answer is what follows.

    The start tag is recognised only at the head of the output (after whitespace): a chat template may put it in the
    prompt instead (DeepSeek-R1, Qwen3.5), so output that does not open with it is reasoning until the end tag when
    :attr:`reasoning_without_start` (the default), and plain content otherwise."""

    start_token: str = "<think>"
    end_token: str = "</think>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any):
        super().__init__(tokenizer, *args, **kwargs)
        if tokenizer is None:
            raise ValueError("the reasoning parser needs the model's tokenizer")
        self.start_token_ids = tag_ids(tokenizer, self.start_token)
        self.end_token_ids = tag_ids(tokenizer, self.end_token)
        # vLLM's attribute names, for callers that expect one id per tag (None where a tag is several tokens)
        self.start_token_id = self.start_token_ids[0] if len(self.start_token_ids) == 1 else None
        self.end_token_id = self.end_token_ids[0] if len(self.end_token_ids) == 1 else None

    @property
    def reasoning_without_start(self) -> bool:
        return True

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        end = rfind_seq(input_ids, self.end_token_ids)
        return end >= 0 and rfind_seq(input_ids, self.start_token_ids, end) < 0

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        n = len(list(delta_ids)) + len(self.end_token_ids) - 1
        return rfind_seq(input_ids, self.end_token_ids, max(len(input_ids) - n, 0)) >= 0

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        end = rfind_seq(input_ids, self.end_token_ids)
        return [] if end < 0 else list(input_ids[end + len(self.end_token_ids):])

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        end = rfind_seq(token_ids, self.end_token_ids)
        if end < 0:
            return len(token_ids) if self.reasoning_without_start else 0
        start = rfind_seq(token_ids[:end], self.start_token_ids)
        return end - (start + len(self.start_token_ids) if start >= 0 else 0)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        head = text.lstrip()
        if head.startswith(self.start_token):
            body = head[len(self.start_token):]
        elif not final and (not head or self.start_token.startswith(head)):
            return "", ""  # may still become the start tag
        elif self.reasoning_without_start:
            body = text
        else:
            return "", text
        i = body.find(self.end_token)
        if i >= 0:
            return body[:i], body[i + len(self.end_token):]
        hold = 0 if final else longest_partial_suffix(body, (self.end_token,))
        return body[:len(body) - hold], ""
