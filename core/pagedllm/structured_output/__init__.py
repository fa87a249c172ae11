"""Structured outputs: grammars (JSON schema, regex, choice, EBNF/Lark) that constrain sampling token by token.

``limits`` holds the deployer's limits (``StructuredOutputsConfig``); the server checks them and compiles each
request's grammar in ``compile_pool.GrammarCompilePool`` (worker processes with a time limit, apart from the engine),
then hands the engine a ``PrecompiledSpec``. ``manager.StructuredOutputManager`` loads (or, offline, compiles) grammars
off the engine's hot loop, cached by spec, and gives each request a matcher; each step's ``GrammarBitmask`` goes to the
worker with the step, which masks disallowed tokens through the backend op ``apply_token_bitmask``.
"""

from pagedllm.structured_output.limits import GrammarLimitError, StructuredOutputsConfig, check_spec
from pagedllm.structured_output.manager import (BACKENDS, GRAMMAR_DEAD_END, GrammarBitmask, StructuredOutputManager,
                                                StructuredRequest)
from pagedllm.structured_output.precompiled import PrecompiledSpec

__all__ = ["BACKENDS", "GRAMMAR_DEAD_END", "GrammarBitmask", "GrammarLimitError", "PrecompiledSpec",
           "StructuredOutputManager", "StructuredOutputsConfig", "StructuredRequest", "check_spec"]
