"""StructuredOutputManager: compiles each request's grammar off the hot loop and builds the per-step token bitmask.

As in vLLM v1: the scheduler does not schedule a request until its grammar is ready. Each
request (each of ``n`` samples) gets its own matcher, advanced by every sampled token; the matcher's state follows
``output_token_ids``, which recompute preemption keeps, so preempted requests resume where they were. After each
schedule the engine asks ``grammar_bitmask`` for the step's masks and hands them to the worker with the step (vLLM's
``get_grammar_bitmask`` beside the scheduler output): the worker never sees a grammar.

Served requests arrive precompiled (``PrecompiledSpec``: the server's compile pool checked the limits and compiled
them in worker processes with a time limit), so the engine only loads them, in its grammar thread. Offline
(``LLM``) specs are checked against the same limits and parsed at ``add_request`` (a bad schema, regex or grammar is
a ParamError naming it, before the request is queued); the tokenizer-dependent compile runs in that thread. Compiled
grammars are cached by spec, bounded by their bytes (``GrammarCache``).

With a reasoning parser (``StructuredOutputsConfig.reasoning_parser``, serve's ``--reasoning-parser``) a grammar
constrains the answer, not the thinking, as in vLLM: while a request reasons its row of the bitmask allows every
token and its matcher does not advance (``should_advance``); the token that ends the reasoning (``</think>``) is the
last one left free, and the grammar applies from the next. A prompt that already ends the reasoning (Qwen3 with
``enable_thinking=False``) is constrained from its first token.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pagedllm.errors import ParamError
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sched.request import Request
from pagedllm.sched.scheduler import ScheduledRequest
from pagedllm.structured_output.backend_guidance import GuidanceBackend
from pagedllm.structured_output.backend_xgrammar import XgrammarBackend
from pagedllm.structured_output.limits import StructuredOutputsConfig, check_spec
from pagedllm.structured_output.precompiled import PrecompiledSpec

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
#: ``stop_reason`` of a request ended with finish reason "error" because its grammar allowed no next token.
GRAMMAR_DEAD_END = ("grammar_dead_end: the grammar allows no token at this point of the output (a string it requires "
                    "cannot be spelt with this model's vocabulary, or min_tokens forbids ending where it ends)")
_CACHE_ENTRIES = 512
_MAX_ERROR_CHARS = 1000  # most compiled grammars kept, whatever their size
_REASONING_TAIL = 63  # tokens before a new one that the reasoner sees (an end tag spelt in up to that many)


class StructuredRequest:
    """One request's grammar: a compile future, then its own matcher, advanced first over ``prefix`` (tokens already
    generated under this grammar: beam search continues a beam as a new request)."""

    def __init__(self, future: cf.Future, backend: Any, json_output: bool = False, prefix: Sequence[int] = (),
                 reasoning_ended: bool = True):
        self.future = future
        self.backend = backend
        self.json_output = json_output  # the output is JSON (json / json_object)
        self.prefix = list(prefix)
        self.matcher: Any = None
        self._error: Optional[BaseException] = None
        self.reasoning_ended = reasoning_ended  # False while the request reasons: the grammar waits (vLLM's name)

    def sibling(self) -> "StructuredRequest":
        """The same grammar for another sample of the request (shared compile, own matcher)."""
        return StructuredRequest(self.future, self.backend, self.json_output, self.prefix, self.reasoning_ended)

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


class GrammarCache:
    """Compile futures by spec key, least recently used first out, bounded by the compiled grammars' bytes (and
    :data:`_CACHE_ENTRIES`), checked at every lookup and insertion. A grammar still compiling counts once it is
    done, so the newest entry may hold the cache over its bound until the next lookup."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, tuple[cf.Future, Any]] = OrderedDict()

    def get(self, key: tuple) -> Optional[cf.Future]:
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        self._evict()
        return hit[0]

    def put(self, key: tuple, fut: cf.Future, backend: Any) -> None:
        self._entries[key] = (fut, backend)
        self._entries.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        while len(self._entries) > _CACHE_ENTRIES or (len(self._entries) > 1 and self.nbytes() > self.max_bytes):
            self._entries.popitem(last=False)

    def nbytes(self) -> int:
        return sum(be.size(f.result()) for f, be in self._entries.values() if f.done() and f.exception() is None)

    def __len__(self) -> int:
        return len(self._entries)


class Backends:
    """The grammar backends of one tokenizer, built on first use, and the ``auto`` fallback (xgrammar, then
    llguidance for what xgrammar refuses). Shared by the engine's manager and the server's compile workers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str = "auto"):
        if backend not in BACKENDS:
            raise ParamError("structured_outputs_backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.names = ["xgrammar", "guidance"] if backend == "auto" else [backend]
        self._built: dict[str, Any] = {}
        self._broken: dict[str, str] = {}  # backend -> why it cannot work with this tokenizer

    def get(self, name: str) -> Any:
        be = self._built.get(name)
        if be is None:
            if name in self._broken:
                raise ParamError("structured_outputs", self._broken[name])
            cls = XgrammarBackend if name == "xgrammar" else GuidanceBackend
            try:
                be = self._built[name] = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
            except Exception as e:  # noqa: BLE001 - e.g. llguidance on a tokenizer whose decoder it cannot read
                self._broken[name] = f"the {name} grammar backend cannot use this model's tokenizer ({e})"
                logger.warning("structured outputs: %s", self._broken[name])
                raise ParamError("structured_outputs", self._broken[name]) from None
        return be

    def parse(self, spec: StructuredOutputsParams) -> tuple[str, Any, Any]:
        """(backend name, backend, parsed grammar) of the first backend that accepts ``spec``; else the ParamError
        of the last that could parse it (a backend that cannot be built for this tokenizer never hides the error
        of the one before it)."""
        error: Optional[ParamError] = None
        for name in self.names:
            try:
                be = self.get(name)
            except ParamError as e:
                if error is None:
                    error = e
                continue
            try:
                return name, be, be.parse(spec)
            except ParamError as e:
                error = e
        if len(error.message) > _MAX_ERROR_CHARS:  # the libraries quote the whole spec: a 100 KB regex, say
            error = ParamError(error.field, error.message[:_MAX_ERROR_CHARS] + " ... (truncated)")
        raise error


class StructuredOutputManager:
    """``backend``: ``auto`` (xgrammar, then llguidance for what xgrammar refuses), ``xgrammar`` or ``guidance``.
    Backends are built on first use: an engine that never sees a grammar never loads their libraries. ``config``:
    the deployer's limits (``limits.StructuredOutputsConfig``), checked on every spec that is not precompiled."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], backend: str = "auto",
                 config: Any = None):
        self.backends = Backends(tokenizer, vocab_size, stop_token_ids, backend)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.config = StructuredOutputsConfig.parse(config)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        self._cache = GrammarCache(self.config.cache_bytes)
        self.reasoner: Optional[ReasoningParser] = None  # vLLM's name: the parser that says when reasoning ends
        if self.config.reasoning_parser and not self.config.enable_in_reasoning and tokenizer is not None:
            self.reasoner = get_reasoning_parser(self.config.reasoning_parser, tokenizer)

    def shutdown(self) -> None:
        """Stop the compile thread (the engine's shutdown): compiles not started are cancelled, a running one ends."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def new_request(self, spec: StructuredOutputsParams, prefix: Sequence[int] = (),
                    prompt_token_ids: Optional[Sequence[int]] = None) -> StructuredRequest:
        """Start (or reuse) the grammar of ``spec``: a :class:`PrecompiledSpec` (the server compiled it) is only
        loaded, off the step loop; another spec is checked against the limits and parsed now (ParamError if it is
        over a limit or cannot compile), then compiled in the manager's thread. With a reasoner, the grammar waits
        for the end of the reasoning unless ``prompt_token_ids`` already end it."""
        req = self._new_request(spec, prefix)
        if self.reasoner is not None:
            req.reasoning_ended = self.reasoner.is_reasoning_end(list(prompt_token_ids or ()))
        return req

    def should_advance(self, request: Request, token: int) -> bool:
        """Whether ``token`` (sampled, not yet appended) goes to the request's matcher (vLLM's ``should_advance``):
        not while the request reasons; the token that ends the reasoning flips the request to constrained from
        the next one."""
        structured = request.structured
        if structured.reasoning_ended:
            return True
        if self.reasoner.is_reasoning_end_streaming(request.all_token_ids[-_REASONING_TAIL:] + [token], [token]):
            structured.reasoning_ended = True
        return False

    def _new_request(self, spec: StructuredOutputsParams, prefix: Sequence[int]) -> StructuredRequest:
        if self.tokenizer is None:
            raise ParamError("structured_outputs", "needs a tokenizer (the engine was started without one)")
        json_output = spec.kind in ("json", "json_object")
        if isinstance(spec, PrecompiledSpec):
            be = self.backends.get(spec.backend)
            key = (spec.backend,) + spec.key
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._load, be, spec)
                self._cache.put(key, fut, be)
            return StructuredRequest(fut, be, json_output, prefix)
        check_spec(spec, self.config)
        for name in self.backends.names:
            fut = self._cache.get((name,) + spec.key)
            if fut is not None:
                return StructuredRequest(fut, self.backends.get(name), json_output, prefix)
        name, be, grammar = self.backends.parse(spec)
        fut = self._pool.submit(be.compile, grammar)
        self._cache.put((name,) + spec.key, fut, be)
        return StructuredRequest(fut, be, json_output, prefix)

    @staticmethod
    def _load(be: Any, spec: PrecompiledSpec) -> Any:
        try:
            return be.load(spec.payload)
        except Exception as e:  # noqa: BLE001 - compiled for another tokenizer view (stop ids): compile it here
            logger.warning("structured outputs: a precompiled grammar did not load (%s); compiling it in the "
                           "engine", e)
            return be.compile(be.parse(spec))

    @staticmethod
    def wait(reqs: Sequence[StructuredRequest], timeout: float) -> None:
        """Block until one of ``reqs``' grammars finished compiling (or ``timeout``): an engine with nothing else
        to do sleeps here instead of spinning."""
        cf.wait([r.future for r in reqs], timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def grammar_bitmask(self, scheduled: Sequence[ScheduledRequest]) -> Optional[GrammarBitmask]:
        """The masks of the scheduled requests that sample this step and follow a grammar, from their matchers'
        state now (a request's matcher only advances once its step returns), or None when no row is constrained."""
        reqs = [s.request for s in scheduled if s.samples and s.request.structured is not None
                and s.request.structured.reasoning_ended]
        if not reqs:
            return None
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(reqs), words), -1, dtype=torch.int32)
        for j, r in enumerate(reqs):
            m = r.structured.matcher
            if m is not None and not m.is_terminated():
                m.fill(mask, j)
        # A row the grammar leaves no token in (its strings cannot be spelt with this vocabulary) stays unmasked so its sampler row stays finite: the matcher rejects whatever it
        # samples and the engine ends the request with finish reason "error" instead of emitting that token.
        dead = ~(mask != 0).any(dim=1)
        if bool(dead.any()):
            mask[dead] = -1
        return GrammarBitmask([r.request_id for r in reqs], mask)
