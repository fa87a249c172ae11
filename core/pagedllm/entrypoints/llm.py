"""Offline API, a drop-in for vLLM's ``LLM``: generate, chat, (beam search in beam_search.py).

Lifecycle: ``llm.shutdown()`` (idempotent) or ``with LLM(...) as llm:`` releases the engine — a distributed one's
worker processes, process group and ports, the model and KV caches — so another engine, of any parallel shape, can
start in the same process. An LLM dropped without it is released when it is garbage collected (the engine's
finalizer), and any left at interpreter exit then.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Optional, Sequence, Union

import torch
from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                              PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
from pagedllm.pooling_params import PoolingParams
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import default_sampling_params, get_diff_sampling_param
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.entrypoints.beam_search import beam_search
from pagedllm.entrypoints.chat_inputs import mm_prompt, model_modalities
from pagedllm.multimodal.content_parts import parse_chat_messages
from pagedllm.multimodal.media import MediaConnector


class LLM:
    """``LLM(model, device=..., dtype=..., max_model_len=..., block_size=None, enable_prefix_caching=True, ...)``.

    Any :class:`~pagedllm.config.EngineConfig` field is accepted as a keyword.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        dp = kwargs.pop("data_parallel_size", 1)
        if dp != 1:
            raise ParamError("data_parallel_size", f"the offline LLM runs one engine (got {dp!r}); for data "
                                                   "parallel serve with `pagedllm serve --data-parallel-size N`, or "
                                                   "run one LLM per process on its share of the prompts")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0
        #: The model's generation_config.json sampling defaults (``generation_config``: auto | vllm | a folder)
        self.default_sampling_params = get_diff_sampling_param(self.llm_engine.model_path,
                                                               self.llm_engine.config.generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without SamplingParams: the model's generation defaults (vLLM's)."""
        return default_sampling_params(self.default_sampling_params)

    def shutdown(self) -> None:
        """Release the engine (idempotent): a distributed engine's other ranks exit, its process group and ports
        close, and the model and KV caches are dropped. Generating afterwards raises ``EngineClosedError``."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or None for the base model) per prompt.
        A prompt is a string, token ids, or vLLM's dict (``prompt`` / ``prompt_token_ids``, and for a
        vision-language model ``multi_modal_data={"image": Image or [Image, ...]}``: docs/multimodal.md)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        final = {id(p): p.clone(output_kind="final_only") for p in params}  # generate() only reads final outputs
        params = [final[id(p)] for p in params]
        engine = self.llm_engine
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                engine.add_request(rid, p, sp, priority=priority[i] if priority is not None else None,
                                   lora_request=loras[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # all-or-nothing: nothing half-queued stays behind
            raise
        return self._run(ids, use_tqdm)

    # ---- pooling (docs/pooling.md): an engine started with runner="pooling" / convert=... -------------------------
    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
               truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
               lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
               pooling_task: Optional[str] = None) -> list[PoolingRequestOutput]:
        """Pool every prompt (``pooling_task``: embed | classify | score | reward | encode; default: the model's
        task, or each PoolingParams' own); outputs in prompt order, ``outputs.data`` the pooled tensor."""
        prompts = self._as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = (list(pooling_params) if isinstance(pooling_params, (list, tuple))
                  else [pooling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params: got {len(params)} for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, PoolingParams):
                raise ParamError("pooling_params", f"must be PoolingParams, got {type(p).__name__}")
            changes = {}
            if pooling_task is not None:
                changes["task"] = pooling_task
            if truncate_prompt_tokens is not None:
                changes["truncate_prompt_tokens"] = truncate_prompt_tokens
            if changes:
                params[i] = p.clone(**changes)
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: got {len(loras)} for {len(prompts)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for p, pp, lora in zip(prompts, params, loras):
                rid = f"pool-{self._counter}"
                self._counter += 1
                engine.add_request(rid, p, pp, lora_request=lora)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], *,
              truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``)."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, use_tqdm: bool = True,
                 pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``) of a classification model."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(self, prompts: Union[PromptType, Sequence[PromptType]], *,
               truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
               lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
               ) -> list[PoolingRequestOutput]:
        """Per-token rewards (``outputs.data``: ``[tokens, labels]``) of a reward / classification model."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="reward")

    def score(self, text_1: Union[PromptType, Sequence[PromptType]], text_2: Union[PromptType, Sequence[PromptType]],
              *, truncate_prompt_tokens: Optional[int] = None, use_tqdm: bool = True,
              pooling_params: Optional[PoolingParams] = None,
              lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
              ) -> list[ScoringRequestOutput]:
        """Similarity scores of ``text_1`` against ``text_2``: 1-to-1, 1-to-N (one ``text_1``) or N-to-N (equal
        lengths). A cross-encoder (a one-label classifier) scores each pair tokenized as its tokenizer pairs them;
        an embedding model (bi-encoder) scores the cosine similarity of the two embeddings."""
        spec = self.llm_engine.pooling
        if spec is None:
            raise ParamError("runner", f"model {self.llm_engine.config.model} runs the generate runner; score needs "
                                       "runner='pooling' (--runner pooling)")
        if "score" not in spec.tasks and spec.convert != "embed":
            raise ParamError("task", f"score needs a cross-encoder (a one-label classifier) or an embedding model; "
                                     f"{spec.architecture} is a {spec.num_labels}-label classifier")
        firsts = [text_1] if isinstance(text_1, (str, dict)) else list(text_1)
        seconds = [text_2] if isinstance(text_2, (str, dict)) else list(text_2)
        if not firsts or not seconds:
            raise ParamError("text_1" if not firsts else "text_2", "must not be empty")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ParamError("text_2", f"got {len(seconds)} texts for {len(firsts)} text_1 texts (1-to-1, 1-to-N "
                                       "or N-to-N)")
        pp = pooling_params if pooling_params is not None else PoolingParams()
        if "score" not in spec.tasks:  # bi-encoder
            embs = self.encode(firsts + seconds, pp, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
            n = len(firsts)
            out = []
            for a, b in zip(embs[:n], embs[n:]):
                sim = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
                out.append(ScoringRequestOutput.from_base(PoolingRequestOutput(
                    f"{a.request_id}_{b.request_id}", PoolingOutput(sim.reshape(1)),
                    a.prompt_token_ids + b.prompt_token_ids, 0, True)))
            return out
        tok = self.get_tokenizer()
        if tok is None:
            raise ParamError("text_1", "a cross-encoder scores text pairs with the model's tokenizer; this model has "
                                       "none")
        pairs = []
        for i, (a, b) in enumerate(zip(firsts, seconds)):
            if not isinstance(a, str) or not isinstance(b, str):
                raise ParamError("text_1" if not isinstance(a, str) else "text_2",
                                 f"a cross-encoder scores text pairs; item {i} is not a string")
            enc = tok(text=a, text_pair=b)
            prompt = {"prompt_token_ids": list(enc["input_ids"])}
            if "token_type_ids" in enc:
                prompt["token_type_ids"] = list(enc["token_type_ids"])
            pairs.append(prompt)
        outs = self.encode(pairs, pp, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="score")
        return [ScoringRequestOutput.from_base(o) for o in outs]

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"requests vanished without finishing: {sorted(pending)[:5]}")
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, chat_template_kwargs: Optional[dict[str, Any]] = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or ``chat_template``) and generate. ``chat_template_kwargs``: extra
        template variables (e.g. ``enable_thinking``, ``reasoning_effort``), as vLLM's. Content may be OpenAI parts
        (``text``, ``image_url``, ``input_image``, vLLM's ``image_pil``; docs/multimodal.md): an image a model cannot
        take, or more than ``limit_mm_per_prompt`` allows, is a ``ValueError`` naming the part."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat: this model has no tokenizer")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        config = self.llm_engine.config
        if getattr(self, "_modalities", None) is None:
            self._modalities = model_modalities(self.llm_engine.model_path, config.hf_overrides)
        media = MediaConnector(config.allowed_local_media_path, config.allowed_media_domains)
        prompts = []
        for conv in conversations:
            chat = parse_chat_messages(conv, self._modalities, config.limit_mm_per_prompt)
            ids = tok.apply_chat_template(chat.messages, chat_template=chat_template, tokenize=True,
                                          add_generation_prompt=add_generation_prompt, return_dict=False,
                                          **(chat_template_kwargs or {}))
            prompts.append(mm_prompt(ids, chat.load_images(media)))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
                    use_tqdm: bool = False) -> list:
        """vLLM's ``LLM.beam_search``: beams share their common prefix's blocks through the prefix cache."""
        return beam_search(self, prompts, params, use_tqdm, lora_request)
