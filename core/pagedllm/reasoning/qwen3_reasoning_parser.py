"""Qwen3: ``<think>``...``</think>`` in the output (Qwen3.5's template opens ``<think>`` in the prompt, so output
before ``</think>`` is reasoning either way); with ``chat_template_kwargs={"enable_thinking": false}`` the model
does not think and the whole output is content (vLLM's rule)."""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParserManager
from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    @property
    def reasoning_without_start(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))
