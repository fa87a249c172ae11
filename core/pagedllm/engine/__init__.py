"""The engine process: ``LLMEngine`` (requests in, ``RequestOutput`` out), the engine-core process the server talks
to, its async client, data-parallel clients, and CPU pinning.

- ``llm_engine``: add / step / abort, stats; scheduler + executor + output processor.
- ``output_processor`` / ``detokenizer``: incremental text, stop strings, logprobs.
- ``core_process``: the engine loop in its own process (``run_engine_core``).
- ``async_engine``: the server side's client of that process.
- ``dp_client`` / ``dp_lockstep``: data-parallel replicas, and their lock step for expert parallel.
- ``prefix_router``: which replica a request goes to (cache-aware: the longest recorded prefix within a load bound).
- ``cpu_split``: ``--engine-cpus``, the engine's and the HTTP process's CPU sets.
"""

from __future__ import annotations

from pagedllm.deprecated import package_attr


def __getattr__(name: str):
    if name == "LLMEngine":  # ``from pagedllm.engine import LLMEngine`` (vLLM's spelling)
        from pagedllm.engine.llm_engine import LLMEngine  # heavy: torch (`import pagedllm.engine` stays light)

        return LLMEngine
    return package_attr(__name__, name)  # contract v2's ``pagedllm.engine`` module
