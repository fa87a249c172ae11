"""Structured outputs: grammars (JSON schema, regex, choice, EBNF/Lark) that constrain sampling token by token.

``manager.StructuredOutputManager`` compiles grammars off the engine's hot loop (cached by spec) and gives each
request a matcher; each step's ``GrammarBitmask`` goes to the worker with the step, which masks disallowed tokens
through the backend op ``apply_token_bitmask``.
"""

from pagedllm.structured_output.manager import BACKENDS, GrammarBitmask, StructuredOutputManager, StructuredRequest

__all__ = ["BACKENDS", "GrammarBitmask", "StructuredOutputManager", "StructuredRequest"]
