"""LLMEngine: add requests, step (schedule -> run -> sample -> update -> detokenize), abort, stats."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union


from pagedllm.backend.registry import get_backend
from pagedllm.config import EngineConfig, resolve_config
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.executor.base import make_executor
from pagedllm.kv_transfer.runtime import KVTransfer, build_kv_transfer
from pagedllm.sched.kv_groups import HybridKVCacheManager
from pagedllm.sched.kv_manager import BlockPool, KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.models import load_config, load_tokenizer, resolve_model_path
from pagedllm.worker.model_runner import PendingStep, StepOutput
from pagedllm.models.info import read_model_info
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.multimodal.prefix_lm import check_token_budget
from pagedllm.multimodal.processing import MultiModalProcessor, ProcessedPrompt, as_image_list, prompt_parts
from pagedllm.multimodal.shared_tensors import load_features
from pagedllm.multimodal.registry import processor_class, supported_modalities
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling import check_request
from pagedllm.pooling_params import PoolingParams
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sample.sampler import SamplerOutput
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.scheduler import Scheduler, SchedulerOutput
from pagedllm.spec_decode.manager import build as build_spec_decoder
from pagedllm.startup_log import stage
from pagedllm.structured_output import GRAMMAR_DEAD_END, GrammarBitmask, StructuredOutputManager
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict]


class EngineClosedError(RuntimeError):
    """The engine was shut down (``LLM.shutdown()``, ``with LLM(...)``) and cannot run requests any more."""


def _release(owned: list[Any]) -> None:
    """Shut down what an engine owns, newest first (its finalizer: must not refer to the engine itself)."""
    while owned:
        obj = owned.pop()
        try:
            obj.shutdown()
        except Exception:  # noqa: BLE001 - release the rest; a finalizer cannot raise to anyone
            logger.exception("engine shutdown: releasing %s failed", type(obj).__name__)


@dataclass
class EngineStats:
    """Counters and gauges for /metrics and tests (vLLM's meanings)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_prompt_tokens: int = 0  # prefill tokens actually run through the model (cache hits excluded)
    generation_tokens: int = 0
    num_swaps: int = 0
    live_token_slots: int = 0  # tokens with K/V held by running requests
    allocated_token_slots: int = 0  # blocks held by running requests x block_size
    slot_steps_live: int = 0  # the two above summed over every step: utilisation = live / allocated
    slot_steps_allocated: int = 0
    slot_steps_seqs: int = 0  # running sequences summed over steps (what contiguous preallocation would reserve)
    num_steps: int = 0  # model steps run
    lora_disk_loads: int = 0  # LoRA adapter folders read from disk
    lora_cpu_evictions: int = 0  # host copies dropped by the max_cpu_loras LRU
    lora_slot_loads: int = 0  # adapters copied into a device slot
    lora_slot_evictions: int = 0  # adapters swapped out of a device slot for another
    max_loras: int = 0  # 0: LoRA disabled
    running_loras: tuple = ()  # names of the adapters running requests use (vLLM's lora_requests_info)
    waiting_loras: tuple = ()
    spec_decode_enabled: bool = False  # a speculative_config is set (its metrics are exported)
    spec_decode_num_drafts: int = 0  # speculative verifications (requests x steps with proposals)
    spec_decode_num_draft_tokens: int = 0  # tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of which accepted
    spec_decode_acceptance_rate: float = 0.0  # accepted / proposed
    spec_decode_mean_accepted_length: float = 0.0  # tokens emitted per verification (1 + accepted / drafts)
    # DP+EP replicas (entrypoints/dp_lockstep.py): lock-step forwards, of them the dummy ones (no own requests), and
    # the lock-step waves completed (equal on every replica)
    dp_steps: int = 0
    dp_dummy_steps: int = 0
    dp_waves: int = 0
    # KV connector counters (docs/kv-offload.md): per tier hits / misses / bytes, load errors, recomputes...
    kv_offload: dict = field(default_factory=dict)
    # images run through this engine's own processor (offline API) / received already processed (the server's
    # render workers: docs/multimodal.md)
    mm_items_processed: int = 0
    mm_items_preprocessed: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.backend = get_backend(config.device)
        self.model_path = resolve_model_path(config.model)
        hf_config = load_config(self.model_path)
        for key, value in (config.hf_overrides or {}).items():  # vLLM's hf_overrides (e.g. a reranker's head)
            setattr(hf_config, key, value)
        info = read_model_info(self.model_path, hf_config, config.model_impl)
        self.config = config = resolve_config(config, self.backend, info)  # every field checked before loading
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.model_path, hf_config)
        # tensor/pipeline parallel: the executor starts the other ranks; rank 0's Worker is this engine's
        self.executor = make_executor(config, self.model_path)
        # What outlives this object unless released: shutdown(), else its finalizer (garbage collection or
        # interpreter exit) releases it
        self._owned: list[Any] = [self.executor] if self.executor is not None else []
        self._finalizer = weakref.finalize(self, _release, self._owned)
        self._closed = False
        try:
            self.worker = w = (self.executor.driver_worker if self.executor is not None
                               else Worker(config, self.backend, self.model_path, hf_config, info))
            self.model, self.device, self.dtype, self.max_model_len = w.model, w.device, w.dtype, w.max_model_len
            self.num_blocks = w.num_blocks
            # (an encoder-only model holds no KV: a one-block manager nothing allocates from)
            layout = getattr(w, "kv_layout", None)  # sliding-window KV groups (sched/kv_groups.py)
            self.kv = (KVCacheManager(max(1, self.num_blocks), config.block_size, config.enable_prefix_caching)
                       if layout is None else
                       HybridKVCacheManager(self.num_blocks, config.block_size, layout, config.enable_prefix_caching))
            swap_pool = BlockPool(w.num_host_blocks, enable_caching=False) if w.host_caches is not None else None
            self.scheduler = Scheduler(self.kv, w.max_num_seqs, w.max_num_batched_tokens, self.max_model_len,
                                       config.scheduling_policy, swap=swap_pool,
                                       max_loras=config.max_loras if config.enable_lora else 0,
                                       requires_kv_cache=w.requires_kv_cache)
            self.kv_transfer: Optional[KVTransfer] = build_kv_transfer(config, w, self.kv, self.scheduler,
                                                                       self.backend, self.model_path)
            #: The pooling runner's spec (docs/pooling.md); None: this engine generates
            self.pooling = w.pooling
            w.start(self.kv)
            #: The model's HF processor when it takes images (docs/multimodal.md); None: text only
            self.mm_processor = self._start_multimodal(hf_config)
            if self.executor is not None:
                self.executor.attach(w.runner)
            self.spec = build_spec_decoder(config.speculative_config, self.max_model_len, w.draft_proposer)
            self.structured = StructuredOutputManager(self.tokenizer, self.model.vocab_size,
                                                      self.model.eos_token_ids, config.structured_outputs_backend,
                                                      config.structured_outputs_config)
            self._owned.append(self.structured)
            self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
            self.parents: dict[str, ParentRequest] = {}
            self.requests: dict[str, tuple[ParentRequest, Request]] = {}
            self.stats = EngineStats(num_blocks=self.num_blocks)
            self._ids = itertools.count()
            self._warned_spaces = False
            # Pipeline parallel: (step, submitted model step, its grammar masks) in flight, newest first
            # (``_step_with_batch_queue``)
            self.batch_queue: deque[tuple[SchedulerOutput, PendingStep, Optional[GrammarBitmask]]] = deque()
        except BaseException:
            self.shutdown()
            raise
        self.init_seconds = time.perf_counter() - t0
        stage("engine ready in %.2fs: backend=%s dtype=%s block_size=%d blocks=%d max_model_len=%d graph=%s",
              self.init_seconds, self.backend.name, config.dtype, config.block_size, self.num_blocks,
              self.max_model_len, w.graph_level)

    def _start_multimodal(self, hf_config: Any) -> Optional[MultiModalProcessor]:
        """A vision-language model: its processor, and the scheduler's encoder cache and per-step encoder budget
        (``max_num_encoder_input_tokens``, default the token budget; never less than one image)."""
        if not supported_modalities(hf_config) or not hasattr(self.model, "embed_multimodal"):
            return None
        if getattr(self.worker.runner, "encoder_runner", None) is None:
            raise ParamError("model", f"backend {self.backend.name!r} runs its own model runner, which does not run "
                                      "a vision encoder; serve vision-language models on a backend without one")
        budget = max(self.config.max_num_encoder_input_tokens or self.scheduler.max_num_batched_tokens,
                     self.model.num_image_tokens)
        self.scheduler.encoder_cache = EncoderCacheManager(budget)
        self.scheduler.max_num_encoder_input_tokens = budget
        self.scheduler.mm_prefix_lm = bool(getattr(self.model, "mm_prefix_lm", False))  # (multimodal/prefix_lm.py)
        if self.scheduler.mm_prefix_lm:
            check_token_budget(self.scheduler.max_num_batched_tokens, self.model.num_image_tokens)
        return processor_class(hf_config)(self.model_path, hf_config)

    def shutdown(self) -> None:
        """Release everything this engine holds (idempotent): the other ranks of a distributed engine and the
        process group, the grammar compile thread, then the model and the KV caches (dropped here, so they are
        freed even while this object is still referenced). Adding or stepping afterwards raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finalizer()
        finally:
            if hasattr(self, "batch_queue"):  # (absent if the start failed before it, the last one made)
                self.abort_request(list(self.parents))
                self.batch_queue.clear()
            if getattr(self, "kv_transfer", None) is not None:
                self.kv_transfer.shutdown()
            self.worker = self.model = self.spec = None  # what holds tensors (a draft model too)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was shut down; create a new one")

    @property
    def kv_caches(self) -> list:
        return self.worker.kv_caches

    @property
    def graph_level(self) -> str:
        return self.worker.graph_level

    # ---- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, check_length: bool = True) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict) and (as_image_list(prompt.get("multi_modal_data"))  # never dropped silently
                                         or prompt.get("mm_processed") is not None):
            raise ParamError("multi_modal_data", "images are taken by generation requests (add_request, generate) "
                                                 "only, not by this path (tokenize, beam search, pooling)")
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ParamError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ParamError("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str) or not text:
                raise ParamError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise ParamError("prompt", "this engine has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(text)
        if not ids:
            raise ParamError("prompt", "must not be empty")
        vocab = self.model.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ParamError("prompt_token_ids", f"every token id must be an integer in [0, {vocab})")
        if check_length and len(ids) >= self.max_model_len:
            raise ParamError("prompt", f"the prompt has {len(ids)} tokens, but max_model_len is "
                                       f"{self.max_model_len} (prompt plus at least one generated token must fit)")
        return text, list(ids)

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (read and checked now, so a bad folder fails here naming its problem)."""
        self._check_open()
        if self.worker.lora is None:
            raise ParamError("lora_request", "this engine was started without enable_lora (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ParamError("lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}")
        self.worker.lora.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; refused while a request still uses it."""
        if self.worker.lora is None:
            return False
        if any(req.lora_int_id == lora_int_id for _, req in self.requests.values()):
            raise ParamError("lora_int_id", f"adapter {lora_int_id} is in use by a running request")
        return self.worker.lora.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.worker.lora.known.values()) if self.worker.lora is not None else []

    def add_request(self, request_id: Optional[str], prompt: PromptType,
                    params: Union[SamplingParams, PoolingParams, None] = None,
                    arrival_time: Optional[float] = None, priority: Optional[int] = None,
                    lora_request: Optional[LoRARequest] = None, structured_prefix: Sequence[int] = (),
                    multi_modal_data: Optional[dict] = None) -> str:
        """Validate and queue a request (``n`` child samples; a PoolingParams: one pooling request, which
        finishes once its prompt ran). Raises ParamError naming the bad field.

        ``multi_modal_data`` (or the prompt dict's ``"multi_modal_data"``, as vLLM takes it): ``{"image": Image or
        [Image, ...]}`` for a vision-language model, one image placeholder in the prompt per image.

        ``structured_prefix``: the prompt's last tokens were generated under ``params.structured_outputs`` (beam
        search continuing a beam); the grammar starts after them."""
        processed = prompt.get("mm_processed") if isinstance(prompt, dict) else None
        if processed is not None:  # the server's render workers ran the processor: read (and free) the tensors now
            processed = ProcessedPrompt(processed.prompt_token_ids, load_features(processed.mm_features))
        self._check_open()
        if multi_modal_data is None and isinstance(prompt, dict):
            multi_modal_data = prompt.get("multi_modal_data")
        images = as_image_list(multi_modal_data)
        if isinstance(params, PoolingParams):
            if images or processed is not None:
                raise ParamError("multi_modal_data", "pooling requests take text only")
            return self._add_pooling_request(request_id, prompt, params, arrival_time, priority, lora_request)
        if self.pooling is not None and not self.worker.can_generate:
            raise ParamError("runner", f"model {self.config.model} was started with the pooling runner "
                                       f"(runner='pooling', --convert {self.pooling.convert}) and has no LM head to "
                                       "sample with (a classifier or embedding checkpoint): it does not generate; send PoolingParams (embed, classify, score, reward, "
                                       "encode), or serve a generative model")
        params = params if params is not None else SamplingParams()
        if lora_request is not None:
            self.add_lora(lora_request)
        if priority is not None and priority != params.priority:
            params = params.clone(priority=priority)
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.parents:
            raise ParamError("request_id", f"{request_id!r} is already in use")
        text, ids, mm_features = (self._process_images(prompt, images, processed) if images or processed is not None
                                  else (*self.tokenize(prompt), []))
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            if mm_features:
                raise ParamError("truncate_prompt_tokens", "would cut a prompt with images (their placeholders)")
            ids = ids[-params.truncate_prompt_tokens:]
        bad_words = self._check_token_params(params)
        grammar = (self.structured.new_request(params.structured_outputs, structured_prefix, ids)
                   if params.structured_outputs else None)
        parent = ParentRequest(request_id, text, ids, params)
        eos = self.model.eos_token_ids[0] if self.model.eos_token_ids else None
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        arrival = arrival_time if arrival_time is not None else time.time()
        for i in range(params.best_of):
            child_id = request_id if params.best_of == 1 else f"{i}_{request_id}"
            child_params = params if params.seed is None or i == 0 else params.clone(seed=params.seed + i)
            req = Request(child_id, ids, child_params, eos_token_id=eos, prompt=text, arrival_time=arrival,
                          max_tokens=max_tokens, index=i, lora_request=lora_request, parent_id=request_id)
            req.eos_token_ids = set(self.model.eos_token_ids)
            req.bad_words_token_ids = bad_words
            req.mm_features = mm_features
            if mm_features and hasattr(self.mm_processor, "mrope_positions"):  # computed once, read per step
                req.mrope_positions = self.mm_processor.mrope_positions(len(ids), mm_features)
            if grammar is not None:  # each sample follows the grammar with its own matcher (shared compile)
                req.structured = grammar if i == 0 else grammar.sibling()
            parent.children.append(req)
            parent.detoks[child_id] = (IncrementalDetokenizer(self.tokenizer, ids, child_params)
                                       if self.tokenizer is not None and params.detokenize else None)
        self.parents[request_id] = parent
        for req in parent.children:
            self.requests[req.request_id] = (parent, req)
            self.scheduler.add_request(req)
            self.stats.prompt_tokens += len(ids)
        return request_id

    def _process_images(self, prompt: PromptType, images: list, processed: Optional[ProcessedPrompt] = None
                        ) -> tuple[Optional[str], list[int], list]:
        """A prompt with images through the model's HF processor: (text, expanded token ids, one
        ``MultiModalFeatureSpec`` per image); refused for a model that takes no images. ``processed``: the
        processor already ran (the server's render workers); it is taken as is."""
        if self.mm_processor is None:
            raise ParamError("multi_modal_data", f"model {self.config.model} ({self.worker.info.architecture}) takes "
                                                 "no images: it is a text-only model here")
        if processed is not None:
            if images:
                raise ParamError("multi_modal_data", "give images or a processed prompt (mm_processed), not both")
            text = prompt.get("prompt")
            self.stats.mm_items_preprocessed += len(processed.mm_features)
        else:
            text, ids = prompt_parts(prompt)
            processed = self.mm_processor(text, ids, images)
            self.stats.mm_items_processed += len(images)
        _, ids = self.tokenize({"prompt": text, "prompt_token_ids": processed.prompt_token_ids})  # vocab, length
        return text, ids, processed.mm_features

    def _add_pooling_request(self, request_id: Optional[str], prompt: PromptType, params: PoolingParams,
                             arrival_time: Optional[float], priority: Optional[int],
                             lora_request: Optional[LoRARequest]) -> str:
        """Queue one pooling request: no sampling, no detokenizing; its blocks are freed once the prompt ran."""
        if self.pooling is None:
            raise ParamError("runner", f"model {self.config.model} runs the generate runner, which does not pool; "
                                       "start it with runner='pooling' (--runner pooling) or convert='embed' / "
                                       "'classify' / 'reward' (--convert) for embed, classify, score, reward and "
                                       "encode requests")
        params = check_request(self.pooling, params, str(self.config.model))
        if lora_request is not None:
            self.add_lora(lora_request)
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.parents:
            raise ParamError("request_id", f"{request_id!r} is already in use")
        text, ids = self.tokenize(prompt, check_length=False)
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is not None and (len(types) != len(ids) or any(t not in (0, 1) for t in types)):
            raise ParamError("token_type_ids", f"must be {len(ids)} values of 0 or 1, one per prompt token")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            ids = ids[-keep:]
            types = types[-keep:] if types is not None else None
        if len(ids) > self.max_model_len:
            raise ParamError("prompt", f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                                       "(truncate_prompt_tokens keeps the last k)")
        budget = self.scheduler.max_num_batched_tokens
        if not self.scheduler.requires_kv_cache and len(ids) > budget:
            raise ParamError("prompt", f"the prompt has {len(ids)} tokens, but an encoder-only model runs a prompt "
                                       f"whole in one step and max_num_batched_tokens is {budget}")
        parent = ParentRequest(request_id, text, ids, params)
        req = Request(request_id, ids, SamplingParams(max_tokens=1, priority=priority or 0, detokenize=False),
                      prompt=text, arrival_time=arrival_time if arrival_time is not None else time.time(),
                      max_tokens=1, lora_request=lora_request)
        req.pooling_params = params
        req.token_type_ids = list(types) if types is not None else None
        req.pooling_state = self.worker.pooler.new_state(params)
        parent.children.append(req)
        parent.detoks[request_id] = None
        self.parents[request_id] = parent
        self.requests[request_id] = (parent, req)
        self.scheduler.add_request(req)
        self.stats.prompt_tokens += len(ids)
        return request_id

    def _check_token_params(self, params: SamplingParams) -> list[list[int]]:
        """Token ids must be in the model's vocab; returns ``bad_words`` as token id sequences (each word as
        written and with a leading space, as vLLM tokenizes them)."""
        vocab = self.model.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ParamError(name, f"token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if not params.spaces_between_special_tokens and not self._warned_spaces:
            self._warned_spaces = True
            logger.warning("spaces_between_special_tokens=False has no effect with a fast tokenizer (as in vLLM)")
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ParamError("bad_words", "needs a tokenizer (the engine was started without one)")
        out: list[list[int]] = []
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_ids: Union[str, list[str]]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for req in parent.children:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(req.request_id, None)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's supported tasks: ("generate",), or the pooling tasks of a pooling engine (embed, classify...), plus
        "generate" when its model has an LM head (one engine then serves both: generation and pooling requests
        share its steps)."""
        if self.pooling is None:
            return ("generate",)
        return (*self.pooling.tasks, "generate") if self.worker.can_generate else self.pooling.tasks

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.batch_queue)  # (a batch of aborted requests drains)
                or (self.kv_transfer is not None and self.kv_transfer.has_pending()))

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration; returns a (cumulative) RequestOutput for every request that advanced or finished."""
        self._check_open()
        if self.executor is not None and (self.executor.max_concurrent_batches > 1 or self.batch_queue):
            return self._step_with_batch_queue()
        sched, outputs = self._schedule()
        if sched is None:
            return outputs
        step, sampled = self.worker.execute_model(sched.scheduled, self.structured.grammar_bitmask(sched.scheduled))
        return self._update(sched, step, sampled)

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """Pipeline parallel (vLLM's ``step_with_batch_queue``): keep up to ``max_concurrent_batches`` steps of
        disjoint requests in flight. Submit a new batch while the queue has room (returning at once if it still
        has), else complete the oldest: wait for its logits, sample, update. The first stage thus runs batch k + 1
        while the later stages run batch k, and no stage waits for the driver's sampling."""
        q, depth = self.batch_queue, self.executor.max_concurrent_batches
        outputs: list[RequestOutput] = []
        if len(q) < depth:
            # An equal share of what is runnable per free slot, so the batches in flight are about the same size.
            share = -(-self.scheduler.num_schedulable // (depth - len(q)))
            sched, outputs = self._schedule(max(1, share), idle_wait=not q)
            if sched is not None:
                pending = self.worker.submit_model(sched.scheduled)
                self.scheduler.mark_in_flight(sched)
                # Made while the later stages run the batch; its requests' matchers stay put until it returns.
                q.appendleft((sched, pending, self.structured.grammar_bitmask(sched.scheduled)))
                if len(q) < depth and self.scheduler.num_schedulable:
                    return outputs
        if not q:
            return outputs
        sched, pending, grammar = q.pop()
        try:
            step, sampled = self.worker.finish_model(pending, grammar)
        finally:
            self.scheduler.mark_returned(sched)
        return outputs + self._update(sched, step, sampled)

    def _schedule(self, max_seqs: Optional[int] = None,
                  idle_wait: bool = True) -> tuple[Optional[SchedulerOutput], list[RequestOutput]]:
        """Schedule the next step and run what precedes the model (swaps, drafts); returns it (None: nothing to
        run) and the outputs of requests that finished without running."""
        failed = self._drop_failed_grammars()
        if self.spec is not None:
            self.spec.plan(self.scheduler.running)
        sched = self.scheduler.schedule(max_seqs)
        if self.scheduler.encoder_cache is not None:  # encoder outputs the cache evicted: the worker drops them
            self.worker.runner.encoder_runner.free(self.scheduler.encoder_cache.get_freed_mm_hashes())
        if self.kv_transfer is not None:  # evicted blocks saved, external prefix blocks loaded (or recomputed)
            self.kv_transfer.before_forward(sched)
        if failed or not sched:
            outputs = [p.output() for p in failed]
            for p in failed:
                self._retire(p)
            if outputs:
                return None, outputs
            pending = [r.structured for r in self.scheduler.waiting if r.structured is not None]
            if pending and idle_wait:  # nothing runnable until a grammar compiles: sleep on it instead of spinning
                self.structured.wait(pending, timeout=0.05)
            return None, []
        for s in sched.scheduled:
            r = s.request
            prompt_left = r.num_prompt_tokens - s.num_computed_tokens
            if prompt_left > 0:
                self.stats.computed_prompt_tokens += min(prompt_left, s.num_new_tokens)
        if sched.swap_out:  # before the model: freed device blocks (and state slots) may be rewritten in this step
            self.worker.swap(sched.swap_out, out=True, state=sched.state_swap_out)
        if sched.swap_in:
            self.worker.swap(sched.swap_in, out=False, state=sched.state_swap_in)
        if self.spec is not None:  # after the swaps: a draft's K/V moves with its blocks
            self.spec.propose(sched.scheduled)
        self._sample_slot_usage(sched)
        if not sched.scheduled:
            return None, []
        return sched, []

    def _update(self, sched: SchedulerOutput, step: StepOutput,
                sampled: Optional[SamplerOutput]) -> list[RequestOutput]:
        """Apply a completed step: advance the requests, append and check their tokens, emit outputs. A request
        aborted while its batch was in flight is skipped (its blocks were freed at the abort)."""
        generated = self.stats.generation_tokens
        self.stats.num_steps += 1
        # requests whose KV-connector loads failed: rolled back, their step's tokens discarded (recomputed)
        discarded = self.kv_transfer.after_forward(sched) if self.kv_transfer is not None else set()
        self.scheduler.update(sched)
        for req, first, plogits in step.prompt_logits:
            if not req.is_finished and req.request_id not in discarded:
                self.output_processor.record_prompt_logprobs(req, first, plogits)
        outputs: list[Any] = []
        for req, data in step.pooled:  # pooling requests whose prompt completed: done, blocks freed at once
            if req.is_finished or req.request_id in discarded:
                continue
            parent = self.requests[req.request_id][0]
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            outputs.append(PoolingRequestOutput(parent.request_id, PoolingOutput(data), parent.prompt_token_ids,
                                                req.num_cached_tokens, True))
            self._retire(parent)
        touched: dict[str, ParentRequest] = {}
        if step.requests:
            now = time.time()
            for i, req in enumerate(step.requests):
                if req.is_finished or req.request_id in discarded:
                    continue
                parent = self.requests[req.request_id][0]
                # A speculative row emits its accepted drafts plus one token; stop conditions apply per token.
                tokens = sampled.spec_token_ids[i] if sampled.spec_token_ids is not None else [sampled.token_ids[i]]
                proposed = len(step.spec_token_ids[i]) if step.spec_token_ids is not None else 0
                if proposed:
                    self.spec.accept(req, proposed, len(tokens) - 1)
                for token in tokens:
                    done = False
                    if req.structured is not None and req.structured.matcher is not None and \
                            self.structured.should_advance(req, token):  # not while it reasons
                        m = req.structured.matcher
                        if not m.accept(token):  # the grammar allowed no token here: never emit one off-grammar
                            self._finish_grammar_dead_end(parent, req)
                            break
                        done = m.is_terminated()
                    status = self.output_processor.process_token(parent, req, token, sampled.logprobs[i],
                                                                 sampled.sampled_logprob[i], now, grammar_done=done)
                    self.stats.generation_tokens += 1
                    if status is not None:
                        self.scheduler.finish(req, status)
                        break
                if proposed and not req.is_finished:
                    self.scheduler.rollback(req, proposed - (len(tokens) - 1))
                touched[parent.request_id] = parent
        if self.spec is not None:  # the batch throttle times pure decode steps (spec_decode/throttle.py)
            self.spec.end_step(self.stats.generation_tokens - generated,
                               all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled))
        for parent in touched.values():
            if parent.finished or parent.params.output_kind != "final_only":
                outputs.append(parent.output())
            if parent.finished:
                self._retire(parent)
        return outputs

    def _retire(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.requests.pop(c.request_id, None)

    def _finish_grammar_dead_end(self, parent: ParentRequest, req: Request) -> None:
        """End ``req`` with finish reason ``error`` (``stop_reason`` says why), its rejected token not appended."""
        logger.warning("request %s: its grammar allows no token after %d output tokens; finishing with an error",
                       req.request_id, req.num_output_tokens)
        req.stop_reason = GRAMMAR_DEAD_END
        detok = parent.detoks.get(req.request_id)
        if detok is not None:
            detok.finish()
            req.output_text = detok.output_text
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)

    def _drop_failed_grammars(self) -> list[ParentRequest]:
        """A grammar whose compile failed after it parsed: finish its request as aborted (logged) rather than run
        it unconstrained; returns the parents that finished."""
        done: dict[str, ParentRequest] = {}
        for req in [r for r in self.scheduler.waiting if r.structured is not None and r.structured.error is not None]:
            logger.error("request %s: grammar failed: %s", req.request_id, req.structured.error)
            parent = self.requests[req.request_id][0]
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            if parent.finished:
                done[parent.request_id] = parent
        return list(done.values())

    def _sample_slot_usage(self, sched) -> None:
        """Accumulate, over steps, token slots holding K/V after the step vs slots allocated (KV utilisation)."""
        bs = self.kv.block_size
        self.stats.slot_steps_seqs += len(sched.scheduled)
        for s in sched.scheduled:
            self.stats.slot_steps_live += s.num_computed_tokens + s.num_new_tokens
            self.stats.slot_steps_allocated += self.kv.num_blocks_of(s.request.request_id) * bs

    # ---- stats -----------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.stats
        kv = self.kv
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_used_blocks = kv.num_used_blocks
        s.num_cached_blocks = kv.num_cached_blocks
        s.kv_usage = kv.usage
        s.prefix_queries, s.prefix_hits = kv.stats.queries, kv.stats.hits
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_swaps = self.scheduler.num_swaps
        if self.worker is not None and self.worker.lora is not None:
            ls = self.worker.lora.stats
            s.lora_disk_loads, s.lora_cpu_evictions = ls.disk_loads, ls.cpu_evictions
            s.lora_slot_loads, s.lora_slot_evictions = ls.slot_loads, ls.slot_evictions
            s.max_loras = self.worker.lora.max_loras
            s.running_loras = tuple(sorted({r.lora_request.lora_name for r in self.scheduler.running
                                            if r.lora_request is not None}))
            s.waiting_loras = tuple(sorted({r.lora_request.lora_name for r in self.scheduler.waiting
                                            if r.lora_request is not None}))
        if self.spec is not None:
            s.spec_decode_enabled = True
            sp = self.spec.stats
            s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens = sp.num_drafts, sp.num_draft_tokens
            s.spec_decode_num_accepted_tokens = sp.num_accepted_tokens
            s.spec_decode_acceptance_rate, s.spec_decode_mean_accepted_length = (sp.acceptance_rate,
                                                                                 sp.mean_accepted_length)
        if self.kv_transfer is not None:
            s.kv_offload = self.kv_transfer.stats()
        s.live_token_slots = sum(r.num_computed_tokens for r in self.scheduler.running)
        s.allocated_token_slots = sum(kv.num_blocks_of(r.request_id) for r in self.scheduler.running) * kv.block_size
        return s
