"""A request's life in the engine: its tokens, how many are computed, and why it finished."""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

import torch

from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import SampleLogprobs
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the request cannot go on (its grammar allows no token): ``stop_reason`` says why

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Tokens are ``prompt + output``; ``num_computed_tokens`` of them have K/V in the cache.

    Preemption by recompute just resets ``num_computed_tokens`` to 0: the next schedule re-prefills prompt and
    output together, so chunked prefill, recompute and decode are one code path (as in vLLM v1).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: Optional[int] = None, prompt: Optional[str] = None,
                 arrival_time: Optional[float] = None, max_tokens: Optional[int] = None, index: int = 0,
                 lora_request: Optional[LoRARequest] = None, parent_id: Optional[str] = None):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id  # the client request it samples for
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.eos_token_ids: set[int] = {eos_token_id} if eos_token_id is not None else set()
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.index = index  # position among a parent's n samples
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0  # 0: the base model
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # In: a KV connector's params from the client (vLLM's); out: the connector's request_finished params.
        self.kv_transfer_params: Optional[dict] = (params.extra_args or {}).get("kv_transfer_params")
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.swapped_blocks: Optional[list[int]] = None  # host blocks holding its K/V while swapped out
        self.stop_reason: object = None
        self.logprobs: Optional[SampleLogprobs] = [] if params.logprobs is not None else None
        # One entry per prompt token; the first has no context, so it is None (as in vLLM).
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.output_text = ""
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.generator: Optional[torch.Generator] = None
        self.structured: Any = None  # structured_output.StructuredRequest when the output follows a grammar
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words, tokenized by the engine
        # Speculative decoding (spec_decode/): lookahead slots the scheduler reserves, n-gram proposals found
        # while planning, the draft model's computed tokens, and the per-request throttle's state.
        self.num_lookahead = 0
        self.spec_token_ids: list[int] = []
        self.draft_num_computed = 0
        self.eagle_hidden: Optional[torch.Tensor] = None  # target features the EAGLE head has not consumed yet
        self.eagle_hidden_start = 0  # position of eagle_hidden's first row
        self.spec_acceptance = 1.0  # running (EMA) acceptance rate of this request's drafts
        self.spec_backoff = 0  # steps to pause after the next low-acceptance verification
        self.spec_skip = 0  # steps left without proposals
        # Pooling requests (docs/pooling.md): their verified PoolingParams and the pooler's per-request state; they
        # finish once the prompt ran, without sampling.
        self.pooling_params: Any = None
        self.pooling_state: Any = None
        self.token_type_ids: Optional[list[int]] = None  # BERT-style segment ids (a cross-encoder's pair), per token
        self.mm_features: list = []  # multimodal.inputs.MultiModalFeatureSpec per image, in prompt order
        self.mrope_positions: Optional[tuple] = None  # M-RoPE: ([3, prompt] positions, decode delta) (mrope.py)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def skip_prefix_cache(self) -> bool:
        """Every prompt position must run through the model: prompt logprobs, and pooling over more than the
        last token (the prefix cache always leaves the last token to compute)."""
        return self.prompt_logprobs is not None or (self.pooling_state is not None
                                                    and self.pooling_state.pooling_type != "LAST")

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return FINISH_REASON.get(self.status)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
