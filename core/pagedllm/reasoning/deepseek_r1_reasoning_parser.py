"""DeepSeek-R1 (and QwQ): ``<think>``...``</think>``; the template may open the ``<think>`` in the prompt, so
everything before ``</think>`` is reasoning."""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    start_token = "<think>"
    end_token = "</think>"
