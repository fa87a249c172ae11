"""StructuredOutputManager: compiles each request's grammar off the hot loop and builds the per-step token bitmask.

As in vLLM v1: ``add_request`` parses the spec at once (a bad schema, regex or grammar is a ParamError naming it,
before the request is queued), the tokenizer-dependent compile runs in a worker thread (cached by spec, so a
repeated schema costs nothing), and the scheduler does not schedule a request until its grammar is ready. Each
request (each of ``n`` samples) gets its own matcher, advanced by every sampled token; the matcher's state follows
``output_token_ids``, which recompute preemption keeps, so preempted requests resume where they were. After each
schedule the engine asks ``grammar_bitmask`` for the step's masks and hands them to the worker with the step (vLLM's
``get_grammar_bitmask`` beside the scheduler output): the worker never sees a grammar.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pagedllm.errors import ParamError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sched.request import Request
from pagedllm.sched.scheduler import ScheduledRequest
from pagedllm.structured_output.backend_guidance import GuidanceBackend
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
_CACHE_SIZE = 512  # compiled grammars kept (xgrammar's compiler also caches by bytes)


class StructuredRequest:
    """One request's grammar: a compile future, then its own matcher, advanced first over ``prefix`` (tokens already
    generated under this grammar: beam search continues a beam as a new request)."""

    def __init__(self, future: cf.Future, backend: Any, json_output: bool = False, prefix: Sequence[int] = ()):
        self.future = future
        self.backend = backend
        self.json_output = json_output  # the output is JSON (json / json_object)
        self.prefix = list(prefix)
        self.matcher: Any = None
        self._error: Optional[BaseException] = None

    def sibling(self) -> "StructuredRequest":
        """The same grammar for another sample of the request (shared compile, own matcher)."""
        return StructuredRequest(self.future, self.backend, self.json_output, self.prefix)

    @property
    def ready(self) -> bool:
        if self.matcher is not None:
            return True
        if not self.future.done() or self.error is not None:
            return False
        matcher = self.backend.matcher(self.future.result(), self.json_output)
        for i, tok in enumerate(self.prefix):
            if not matcher.accept(tok):
                self._error = ParamError("structured_outputs", f"token {tok} at output position {i} does not "
                                                               "follow the grammar")
                return False
        self.matcher = matcher
        return True

    @property
    def error(self) -> Optional[BaseException]:
        if self._error is not None:
            return self._error
        return self.future.exception() if self.future.done() else None


@dataclass
class GrammarBitmask:
    """One step's token masks (vLLM's ``GrammarOutput``): row j of ``mask`` (int32 ``[rows, ceil(vocab / 32)]``, bit
    set = allowed) constrains request ``request_ids[j]``."""

    request_ids: list[str]
    mask: torch.Tensor

    def rows_in(self, reqs: Sequence[Request]) -> tuple[list[int], torch.Tensor]:
        """Positions in ``reqs`` (a step's sampling requests, in the model runner's order) of the constrained ones,
        and their mask rows in that order."""
        index = {rid: j for j, rid in enumerate(self.request_ids)}
        found = [(i, index[r.request_id]) for i, r in enumerate(reqs) if r.request_id in index]
        order = [j for _, j in found]
        mask = self.mask if order == list(range(len(self.request_ids))) else self.mask[order]
        return [i for i, _ in found], mask


class StructuredOutputManager:
    """``backend``: ``auto`` (xgrammar, then llguidance for what xgrammar refuses), ``xgrammar`` or ``guidance``.
    Backends are built on first use: an engine that never sees a grammar never loads their libraries."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str = "auto"):
        if backend not in BACKENDS:
            raise ParamError("structured_outputs_backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.backend_name = backend
        self._backends: dict[str, Any] = {}
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        self._cache: OrderedDict[tuple, cf.Future] = OrderedDict()

    def shutdown(self) -> None:
        """Stop the compile thread (the engine's shutdown): compiles not started are cancelled, a running one ends."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _backend(self, name: str) -> Any:
        be = self._backends.get(name)
        if be is None:
            cls = XgrammarBackend if name == "xgrammar" else GuidanceBackend
            be = self._backends[name] = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return be

    def new_request(self, spec: StructuredOutputsParams, prefix: Sequence[int] = ()) -> StructuredRequest:
        """Parse ``spec`` now (ParamError if it cannot compile) and start (or reuse) its compile."""
        if self.tokenizer is None:
            raise ParamError("structured_outputs", "needs a tokenizer (the engine was started without one)")
        names = ["xgrammar", "guidance"] if self.backend_name == "auto" else [self.backend_name]
        for i, name in enumerate(names):
            key = (name,) + spec.key
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return StructuredRequest(fut, self._backend(name), spec.kind in ("json", "json_object"), prefix)
            be = self._backend(name)
            try:
                grammar = be.parse(spec)
            except ParamError:
                if i + 1 < len(names):
                    continue  # auto: let llguidance try what xgrammar refuses
                raise
            fut = self._pool.submit(be.compile, grammar)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return StructuredRequest(fut, be, spec.kind in ("json", "json_object"), prefix)
        raise AssertionError("unreachable")

    @staticmethod
    def wait(reqs: Sequence[StructuredRequest], timeout: float) -> None:
        """Block until one of ``reqs``' grammars finished compiling (or ``timeout``): an engine with nothing else
        to do sleeps here instead of spinning."""
        cf.wait([r.future for r in reqs], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def grammar_bitmask(self, scheduled: Sequence[ScheduledRequest]) -> Optional[GrammarBitmask]:
        """The masks of the scheduled requests that sample this step and follow a grammar, from their matchers'
        state now (a request's matcher only advances once its step returns), or None when no row is constrained."""
        reqs = [s.request for s in scheduled if s.samples and s.request.structured is not None]
        if not reqs:
            return None
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(reqs), words), -1, dtype=torch.int32)
        for j, r in enumerate(reqs):
            m = r.structured.matcher
            if m is not None and not m.is_terminated():
                m.fill(mask, j)
        return GrammarBitmask([r.request_id for r in reqs], mask)
