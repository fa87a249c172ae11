"""Tool-call parsers for ``tool_choice="auto"`` (``--tool-call-parser NAME``), behind vLLM's ``ToolParser``
interface and ``ToolParserManager`` registry; importing this package registers every built-in parser."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                                ExtractedToolCallInformation, FunctionCall,
                                                                ToolCall)
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser
from pagedllm.entrypoints.openai.tool_parsers.deepseekv3_tool_parser import DeepSeekV3ToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["DeepSeekV3ToolParser", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall",
           "ExtractedToolCallInformation", "FunctionCall", "Hermes2ProToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "PythonicToolParser", "Qwen3CoderToolParser", "StreamedCall", "ToolCall",
           "ToolParser", "ToolParserManager"]
