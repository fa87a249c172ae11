"""Data parallel (``--data-parallel-size N``): N engine replicas behind one API server (vLLM's DPLBAsyncMPClient).

Each replica is a whole engine in its own process (an :class:`AsyncEngine`, so streaming, aborts, timeouts and
errors cross the process boundary exactly as with one engine) holding a full copy of the model and its own KV pool.
A request goes to the replica whose prefix cache most likely holds the longest prefix of its prompt, within a load
bound (``--dp-routing cache_aware``, the default: ``prefix_router.py``), else to the replica with the fewest
unfinished requests (running + waiting, counted here as they are added and finish, so a burst is spread before any
replica has reported a step); ties go round robin. ``--dp-routing least_loaded`` places by load alone. On CPUs each
replica is pinned to its own share of the cores with one torch thread per core (see ``cpu_split.py``).

A replica that dies fails its own in-flight requests (EngineDeadError, as one engine does); from then on the server
refuses new requests with 503 and ``/health`` answers 503. With ``--exit-on-engine-failure`` (the default) every
other replica's requests get the same error too and the server exits for a supervisor to restart it; without it the
other replicas finish what they hold.

With ``--enable-expert-parallel`` on an MoE model (vLLM's DP+EP) the replicas are one expert-parallel group: each
loads 1/N of the experts and they step in lock step, exchanging tokens in every MoE layer (``dp_lockstep.py``,
``distributed/dp_ep.py``); this client forwards a replica's "wave started" to the others. One replica dying then
stops them all (their next exchange fails), as in vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from typing import AsyncIterator, Callable, Optional, Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import EngineStats, PromptType
from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream, encode_stream
from pagedllm.engine.prefix_router import DPRoutingConfig, PrefixRouter, RoutingStats
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.lora.request import LoRARequest
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams
from pagedllm.distributed.dp_ep import DPEPConfig, check_dp_ep
from pagedllm.executor.base import free_port
from pagedllm.models import load_config, resolve_model_path

logger = logging.getLogger(__name__)


def split_cpus(cpus: Sequence[int], n: int) -> list[frozenset[int]]:
    """``cpus`` in ``n`` contiguous shares as even as possible (the first ones get the remainder)."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        raise ParamError("data_parallel_size", f"{n} replicas need at least {n} CPUs to pin one each, got "
                                               f"{len(cpus)} ({cpus}); give --engine-cpus or fewer replicas")
    q, r = divmod(len(cpus), n)
    out, pos = [], 0
    for i in range(n):
        k = q + (i < r)
        out.append(frozenset(cpus[pos:pos + k]))
        pos += k
    return out


def prompt_token_ids(prompt: PromptType, params: object, max_model_len: int) -> Optional[list[int]]:
    """The token ids the engine will run for ``prompt`` (after ``truncate_prompt_tokens``), or None when the prompt
    is text (the server always sends ids: it tokenizes before it submits)."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
    else:
        ids = prompt if isinstance(prompt, (list, tuple)) else None
    if ids is None:
        return None
    keep = getattr(params, "truncate_prompt_tokens", None)
    if keep == -1 and isinstance(params, PoolingParams):  # pooling's -1: keep max_model_len
        keep = max_model_len
    return list(ids[-keep:]) if isinstance(keep, int) and 0 < keep < len(ids) else list(ids)


class DataParallelEngine:
    """The AsyncEngine interface over ``len(replica_cpus)`` replicas (started in parallel; a failed start stops
    the others and re-raises). ``replica_cpus[i]``: the CPUs replica ``i`` is pinned to (None: not pinned)."""

    def __init__(self, config: EngineConfig, replica_cpus: Sequence[Optional[frozenset[int]]],
                 stream_interval: int = 1, lora_modules: Sequence[LoRARequest] = (),
                 routing: Optional[DPRoutingConfig] = None):
        n = len(replica_cpus)
        if n < 1:
            raise ParamError("data_parallel_size", f"must be >= 1, got {n}")
        routing = routing if routing is not None else DPRoutingConfig()
        if not isinstance(routing, DPRoutingConfig):
            raise ParamError("dp_routing", f"must be a DPRoutingConfig, got {type(routing).__name__}")
        self.config = config

        #: DP+EP (``--enable-expert-parallel`` with an MoE model): one expert-parallel group over the replicas.
        self.expert_parallel = bool(config.enable_expert_parallel) and n > 1
        dp_ep = self._expert_parallel_configs(config, n) if self.expert_parallel else [None] * n
        if self.expert_parallel:  # the replica engines themselves run one rank each; eager (collectives inside)
            config = replace(config, enable_expert_parallel=False, enforce_eager=True)

        procs: list = []  # the replica processes as they start

        def start(i: int) -> AsyncEngine:
            # replica i: its own device where devices are indexed (config.data_parallel_rank)
            return AsyncEngine(replace(config, data_parallel_rank=i), stream_interval, replica_cpus[i], lora_modules,
                               load_tokenizer=i == 0, index=i, dp_ep=dp_ep[i], on_spawn=procs.append)

        first_error: Optional[BaseException] = None  # the root cause (siblings stopped for it fail after it)
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(start, i) for i in range(n)]
            for f in as_completed(futures):
                if f.exception() is not None and first_error is None:
                    first_error = f.exception()
                if first_error is not None and self.expert_parallel:
                    # The others wait for it in the rendezvous or an exchange: stop them now, not at a timeout.
                    for p in list(procs):
                        try:
                            if p.is_alive():
                                p.kill()
                        except ValueError:  # a replica that failed closed its process object
                            pass
                    break
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for f in futures:
                if f.exception() is None:
                    f.result().shutdown()
            raise first_error if first_error is not None else failed[0]
        self.replicas: list[AsyncEngine] = [f.result() for f in futures]
        self.config = config
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.max_model_len, self.model_path, self.vocab_size = first.max_model_len, first.model_path, first.vocab_size
        self.supported_tasks = first.supported_tasks
        self.loras: dict[str, LoRARequest] = dict(first.loras)
        self.error: Optional[BaseException] = None
        self.on_dead: Optional[Callable[[BaseException], None]] = None
        self._stopping = False
        self.router = PrefixRouter(routing, *self._kv_record_shape())
        for r in self.replicas:
            r.on_dead = self._replica_dead
            if self.expert_parallel:
                r.on_wave = lambda wave, i=r.index: self._wake_others(i, wave)
            logger.info("data parallel: engine %d is process %d%s", r.index, r.pid,
                        f" on CPUs {','.join(map(str, sorted(replica_cpus[r.index])))}" if replica_cpus[r.index]
                        else "")

    def _kv_record_shape(self) -> tuple[int, list[int]]:
        """(block size, blocks per replica) the router's records mirror; capacity 0 where a replica caches no
        prefixes (all replicas are built from one config, so their block sizes agree)."""
        block_size = self.replicas[0].kv_cache.get("block_size", 0)
        caps = [r.stats().num_blocks if r.kv_cache.get("prefix_caching") and
                r.kv_cache.get("block_size") == block_size else 0 for r in self.replicas]
        return block_size, caps

    @staticmethod
    def _expert_parallel_configs(config: EngineConfig, n: int) -> list:
        """One DPEPConfig per replica (checked first: a replica that fails to start would keep the others waiting
        in the rendezvous)."""
        check_dp_ep(load_config(resolve_model_path(config.model)), config, n)
        init = f"tcp://127.0.0.1:{free_port()}"
        return [DPEPConfig(i, n, init, config.distributed_timeout_s) for i in range(n)]

    def _wake_others(self, index: int, wave: int) -> None:
        """DP+EP: replica ``index`` started lock-step wave ``wave``; the others must step with it."""
        for r in self.replicas:
            if r.index != index:
                r.wake(wave)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.replicas]

    # ---- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        for r in self.replicas:
            await r.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every replica (in parallel: each drains its own aborts; idempotent). Every "stop" is sent from this
        thread first: called on the event loop's thread, the loop cannot send them while it waits here."""
        self._stopping = True
        for r in self.replicas:
            r.begin_shutdown()
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.shutdown(timeout), self.replicas))

    @property
    def is_running(self) -> bool:
        return not self._stopping and self.error is None and all(r.is_running for r in self.replicas)

    def _replica_dead(self, err: BaseException) -> None:
        """A replica's process died (its own requests already got ``err``): stop taking requests, tell the server."""
        if self.error is not None or self._stopping:
            return
        index = next((r.index for r in self.replicas if r.error is err), "?")
        self.error = EngineDeadError(f"data-parallel engine {index}: {err}")
        if self.on_dead is None:  # the server stays up: the other engines finish what they hold
            logger.error("%s; refusing new requests (the other engines finish what they hold)", self.error)
            return
        # The server is about to exit (--exit-on-engine-failure): end every request with this error now rather
        # than have the exit cut the survivors' streams.
        for r in self.replicas:
            r.fail_requests(self.error)
        self.on_dead(self.error)

    # ---- requests --------------------------------------------------------------------------------------------
    def pick(self, prompt: Optional[PromptType] = None, params: object = None,
             lora_request: Optional[LoRARequest] = None) -> AsyncEngine:
        """The replica for this prompt: the longest recorded prefix within the load bound, else the one with the
        fewest unfinished requests; ties round robin from the last choice (``prefix_router.py``)."""
        ids = prompt_token_ids(prompt, params, self.max_model_len) if prompt is not None else None
        lora_id = lora_request.lora_int_id if isinstance(lora_request, LoRARequest) else 0
        best = self.router.route(ids, [r.num_unfinished() for r in self.replicas], lora_id)
        return self.replicas[best]

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: Optional[float] = None, priority: Optional[int] = None,
                          timeout: Optional[float] = None, lora_request: Optional[LoRARequest] = None
                          ) -> RequestStream:
        """As :meth:`AsyncEngine.add_request`, on the replica :meth:`pick` chooses (its stream aborts there)."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}" if self.error else "engine is not running")
        if any(r.has_request(request_id) for r in self.replicas):
            raise ParamError("request_id", f"{request_id!r} is already in use")
        return await self.pick(prompt, params, lora_request).add_request(
            request_id, prompt, params, arrival_time, priority, timeout, lora_request)

    def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
               lora_request: Optional[LoRARequest] = None, priority: int = 0, timeout: Optional[float] = None,
               arrival_time: Optional[float] = None) -> AsyncIterator[PoolingRequestOutput]:
        """As :meth:`AsyncEngine.encode`, on the replica :meth:`pick` chooses."""
        return encode_stream(self.add_request, prompt, pooling_params, request_id, lora_request, priority, timeout,
                             arrival_time)

    # ---- LoRA: every replica serves the same adapters --------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        if lora_request.lora_name in self.loras:
            raise ParamError("lora_name", f"an adapter named {lora_request.lora_name!r} is already loaded")
        results = await asyncio.gather(*(r.add_lora(lora_request) for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:  # all or nothing: unload it where it loaded
            await asyncio.gather(*(r.remove_lora(lora_request.lora_name) for r, e in zip(self.replicas, results)
                                   if not isinstance(e, BaseException)), return_exceptions=True)
            raise errors[0]
        self.loras[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> None:
        if lora_name not in self.loras:
            raise ParamError("lora_name", f"no adapter named {lora_name!r} is loaded")
        results = await asyncio.gather(*(r.remove_lora(lora_name) for r in self.replicas), return_exceptions=True)
        del self.loras[lora_name]
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def next_lora_id(self) -> int:
        ids = [r.next_lora_id() for r in self.replicas]  # advanced together: the same id everywhere
        return max(ids)

    # ---- stats -----------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Replica 0's snapshot (per-replica numbers: :meth:`replica_stats`)."""
        return self.replicas[0].stats()

    def replica_stats(self) -> list[tuple[EngineStats, int]]:
        return [(r.stats(), r.num_requests) for r in self.replicas]

    def routing_stats(self) -> RoutingStats:
        """The router's decisions per replica (``pagedllm:dp_routing_*`` on /metrics), a snapshot."""
        return self.router.stats.copy()
