"""Tool-call parsers for ``tool_choice="auto"`` (``--tool-call-parser NAME``), behind vLLM's ``ToolParser``
interface and ``ToolParserManager`` registry; importing this package registers every built-in parser."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (StreamedCall, ToolParser,
                                                                             ToolParserManager)
from pagedllm.entrypoints.openai.tool_parsers.records import (DeltaFunctionCall, DeltaMessage, DeltaToolCall,
                                                                ExtractedToolCallInformation, FunctionCall,
                                                                ToolCall)
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser

__all__ = ["DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall",
           "Hermes2ProToolParser", "Llama3JsonToolParser", "StreamedCall", "ToolCall", "ToolParser",
           "ToolParserManager"]
