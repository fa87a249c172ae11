"""The grammar gate: a served request's structured-output spec is checked and compiled before it reaches the engine.

Order: the deployer's size limits (``structured_output.limits``: choices, characters, schema properties and depth;
linear, no recursion), then a compile in the server's grammar compile pool (worker processes, a time limit,
stopped when the client goes away), then the request goes to the engine as a ``PrecompiledSpec`` that the engine
only loads. Over a limit, uncompilable, or too slow to compile: 400 naming the request's field and,
for a limit, its flag. So no grammar is parsed or compiled on the engine's step loop or the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Optional

from starlette.requests import Request

from pagedllm.entrypoints.openai.errors import APIError, from_param_error
from pagedllm.entrypoints.openai.serving_common import timeout_error, until_disconnect
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import PrecompiledSpec, StructuredOutputsConfig, check_spec
from pagedllm.structured_output.compile_pool import CompileTimeout, GrammarCompilePool
from pagedllm.structured_output.limits import flag

logger = logging.getLogger(__name__)

_pools: "weakref.WeakKeyDictionary[Any, asyncio.Future]" = weakref.WeakKeyDictionary()  # engine -> its pool


def _config(engine: Any) -> StructuredOutputsConfig:
    return StructuredOutputsConfig.parse(getattr(getattr(engine, "config", None), "structured_outputs_config", None))


def _build_pool(engine: Any, tokenizer: Any, config: StructuredOutputsConfig) -> GrammarCompilePool:
    from pagedllm.models import load_config  # heavy: transformers' config classes
    from pagedllm.models.loader import eos_token_ids

    stop = eos_token_ids(engine.model_path, load_config(engine.model_path))  # the engine's stop ids, as it reads them
    backend = getattr(getattr(engine, "config", None), "structured_outputs_backend", "auto")
    return GrammarCompilePool(tokenizer, engine.vocab_size, stop, backend, config)


async def compile_pool(engine: Any, tokenizer: Any) -> GrammarCompilePool:
    """The engine's compile pool, started on first use (off the event loop; a failed start is retried)."""
    task = _pools.get(engine)
    if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
        task = _pools[engine] = asyncio.ensure_future(_start_pool(engine, tokenizer))
    return await asyncio.shield(task)  # a caller that goes away does not stop the start


async def _start_pool(engine: Any, tokenizer: Any) -> GrammarCompilePool:
    pool = await asyncio.to_thread(_build_pool, engine, tokenizer, _config(engine))
    await pool.start()
    return pool


def start_grammar_pool(engine: Any) -> None:
    """Start the compile workers in the background with the server (they take seconds to import their libraries, and
    starting their zygote took ~1 s that /health need not wait for), so the first grammar does not wait for them; a
    failure is logged and retried on the first grammar."""
    if getattr(engine, "tokenizer", None) is None:
        return
    asyncio.ensure_future(compile_pool(engine, engine.tokenizer)).add_done_callback(_log_start_failure)


def _log_start_failure(f: asyncio.Future) -> None:
    if not f.cancelled() and f.exception() is not None:  # e.g. no process could be started; the first grammar retries
        logger.warning("grammar compile workers did not start: %s", f.exception())


async def stop_grammar_pool(engine: Any) -> None:
    task = _pools.pop(engine, None)
    if task is None:
        return
    try:
        pool = await task
    except Exception:  # noqa: BLE001 - it never started: nothing to stop
        return
    await asyncio.to_thread(pool.shutdown)


async def gate_grammar(serving: Any, params: SamplingParams, rename: dict[str, str], raw: Optional[Request],
                       start: float) -> SamplingParams:
    """``params`` with its grammar checked and compiled (unchanged without one). ``serving``: the endpoint's
    ``Serving`` (engine, tokenizer, deadline); ``rename``: engine field names -> the request's; ``raw``: to stop the
    compile when the client disconnects."""
    spec = params.structured_outputs
    if spec is None or isinstance(spec, PrecompiledSpec):
        return params
    field = f"structured_outputs.{spec.kind}"
    config = _config(serving.engine)
    try:
        check_spec(spec, config)
    except ParamError as e:
        raise from_param_error(e, rename) from None
    if serving.tokenizer is None:
        return params  # the engine refuses it, naming the missing tokenizer
    try:
        pool = await compile_pool(serving.engine, serving.tokenizer)
    except Exception as e:  # noqa: BLE001 - no process could be started: the server's trouble, not the request's
        logger.error("grammar compile workers cannot start: %s", e)
        raise APIError(503, "the grammar compile workers are not running", code="grammar_workers_unavailable") from None
    left = serving.remaining(start)  # the request's deadline bounds the wait for a worker and the compile
    budget = config.compile_timeout if left is None else min(config.compile_timeout, left)
    try:
        work = pool.compile(spec, budget, left)
        backend, payload = await (until_disconnect(work, raw) if raw is not None else work)
    except asyncio.TimeoutError:
        raise timeout_error(serving.limits.request_timeout) from None
    except CompileTimeout:
        if budget < config.compile_timeout:
            raise timeout_error(serving.limits.request_timeout) from None
        name = rename.get(field, field)
        raise APIError(400, f"{name}: the grammar did not compile within {config.compile_timeout:g} s (this "
                            f"server's limit, {flag('compile_timeout')})", param=name,
                       code="grammar_compile_timeout") from None
    except ParamError as e:
        raise from_param_error(e, rename) from None
    return params.clone(structured_outputs=PrecompiledSpec.of(spec, backend, payload))
