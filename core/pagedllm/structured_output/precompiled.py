"""PrecompiledSpec: a grammar spec that carries its compiled form, so the engine never parses or compiles it.

The server compiles each request's grammar in its compile pool (``compile_pool.py``: worker processes with a time
limit) and hands the engine this subclass of :class:`~pagedllm.sampling_params.StructuredOutputsParams`: the engine
only loads the compiled grammar (xgrammar's serialized form, or llguidance's validated grammar), which takes
milliseconds and runs off the step loop like any compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.sampling_params import StructuredOutputsParams


@dataclass
class PrecompiledSpec(StructuredOutputsParams):
    backend: str = ""  # the backend that compiled it: xgrammar | guidance
    payload: str = field(default="", repr=False)  # the backend's serialized compiled grammar

    @classmethod
    def of(cls, spec: StructuredOutputsParams, backend: str, payload: str) -> "PrecompiledSpec":
        return cls(json=spec.json, regex=spec.regex, choice=spec.choice, grammar=spec.grammar,
                   json_object=spec.json_object, backend=backend, payload=payload)
