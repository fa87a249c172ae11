"""Reasoning parsers (``--reasoning-parser``): split a reasoning model's output into its reasoning and its answer.

vLLM's interface and names: ``ReasoningParser``, ``ReasoningParserManager.get_reasoning_parser(name)``; parsers
``deepseek_r1``, ``qwen3`` and ``gpt_oss`` (harmony channels; also registered as vLLM's ``openai_gptoss``).
``ReasoningStream`` gives one choice's split whole or per stream delta, identically. docs/reasoning.md.
"""

from pagedllm.reasoning.abs_reasoning_parsers import (DeltaMessage, ReasoningParser, ReasoningParserManager,
                                                      get_reasoning_parser)
from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser
from pagedllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pagedllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
from pagedllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
from pagedllm.reasoning.streaming import ReasoningStream

__all__ = ["BaseThinkingReasoningParser", "DeepSeekR1ReasoningParser", "DeltaMessage", "GptOssReasoningParser",
           "Qwen3ReasoningParser", "ReasoningParser", "ReasoningParserManager", "ReasoningStream",
           "get_reasoning_parser"]
