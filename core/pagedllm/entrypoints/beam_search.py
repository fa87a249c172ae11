"""Beam search on top of the engine, as vLLM's ``LLM.beam_search`` does it.

Every step submits each live beam of every prompt as an ordinary request (its whole token list as the prompt,
``max_tokens=1``, ``logprobs=2*beam_width``) through ``llm.generate``. No beam state lives in the engine: the prefix
cache makes the step cheap, since a beam's full blocks are found by chained hash and shared by reference count with
its siblings and ancestors, and only the tokens after its last full block are computed (the partial block is
"copied on write" by recomputing it into a fresh block). When a request finishes its blocks are freed but stay
cached, so the next step's forks hit them.

Candidates are kept per prompt by cumulative log-probability (raw log-softmax of the model's logits); an EOS
candidate becomes a completed hypothesis (unless ``ignore_eos``); at the end completed and live beams are ranked by
``get_beam_search_score`` and the best ``beam_width`` are returned.

With ``structured_outputs`` every beam follows the grammar: each step's request carries the spec and names the
beam's generated tokens as its grammar prefix, so the mask (and hence every candidate) is the grammar's; tokens the
mask removed have log-probability -inf and never become candidates. With ``lora_request`` every beam of a prompt
runs on that adapter.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence, Union

from tqdm import tqdm

from pagedllm.outputs import Logprob
from pagedllm.errors import ParamError
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import PromptType
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest

_MAX_LOGPROBS = 20  # SamplingParams' limit on logprobs, so beam_width <= 10


@dataclass
class BeamSearchSequence:
    """One hypothesis. ``tokens`` include the prompt (as in vLLM); ``text`` is filled for the returned beams only."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (ended with EOS) | "length" (max_tokens or max_model_len)
    stop_reason: Optional[int] = None  # the EOS id that ended it


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: Union[int, Collection[int], None], length_penalty: float = 1.0) -> float:
    """vLLM's score: ``cum_logprob / len**length_penalty``; len counts the prompt but not a final EOS."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


def beam_search(llm: "LLM", prompts: Union["PromptType", Sequence["PromptType"]], params: BeamSearchParams,
                use_tqdm: bool = False, lora_request: Union["LoRARequest", Sequence, None] = None
                ) -> list[BeamSearchOutput]:
    """Beam search for each prompt (a string or ``{"prompt_token_ids": [...]}``); outputs in prompt order.
    ``lora_request``: one adapter for every prompt, or one per prompt (None = base model)."""
    if 2 * params.beam_width > _MAX_LOGPROBS:
        raise ParamError("beam_width", f"must be <= {_MAX_LOGPROBS // 2} (each step asks for 2*beam_width logprobs), "
                                       f"got {params.beam_width}")
    engine = llm.llm_engine
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    # Tokenize and validate everything first, so a bad prompt fails before any step runs.
    prompt_ids = [engine.tokenize(p)[1] for p in prompts]
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
    if len(loras) != len(prompts):
        raise ParamError("lora_request", f"got {len(loras)} for {len(prompts)} prompts")
    eos = set() if params.ignore_eos else set(engine.model.eos_token_ids)
    width, max_len = params.beam_width, engine.max_model_len

    def score(b: BeamSearchSequence) -> float:
        return get_beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty)

    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width,
                                 detokenize=False, structured_outputs=params.structured_outputs,
                                 output_kind="final_only")
    live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm, dynamic_ncols=True):
        for beams, done in zip(live, completed):  # beams at max_model_len cannot grow: they end here
            done.extend(b for b in beams if len(b.tokens) >= max_len)
            beams[:] = [b for b in beams if len(b.tokens) < max_len]
        flat = [(i, b) for i, beams in enumerate(live) for b in beams]
        if not flat:
            break
        outs = iter(_step(llm, [(b.tokens, len(prompt_ids[i]), loras[i]) for i, b in flat], step_params))
        for i, beams in enumerate(live):
            candidates = []
            for beam in beams:
                step_lps = next(outs).outputs[0].logprobs[0]
                for tok, lp in step_lps.items():
                    if lp.logprob == float("-inf"):  # masked by the grammar (fewer valid tokens than 2*width)
                        continue
                    new = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [step_lps],
                                             beam.cum_logprob + lp.logprob)
                    (completed[i] if tok in eos else candidates).append(new)
            # Live beams of one prompt have equal length, so this is the top-k by cumulative logprob.
            live[i] = heapq.nlargest(width, candidates, key=score)
    tokenizer = engine.tokenizer
    results = []
    for beams, done in zip(live, completed):
        best = sorted(done + beams, key=score, reverse=True)[:width]
        for b in best:
            ended = b.tokens[-1] in eos
            b.finish_reason, b.stop_reason = ("stop", b.tokens[-1]) if ended else ("length", None)
            if tokenizer is not None:
                keep = b.tokens[:-1] if ended and not params.include_stop_str_in_output else b.tokens
                b.text = tokenizer.decode(keep)
        results.append(BeamSearchOutput(best))
    return results


def _step(llm: "LLM", beams: list[tuple[list[int], int, Optional["LoRARequest"]]], params: SamplingParams) -> list:
    """One request per beam (tokens, prompt length, adapter), run to completion; outputs in order."""
    engine = llm.llm_engine
    ids = []
    try:
        for tokens, prompt_len, lora in beams:
            ids.append(engine.add_request(None, {"prompt_token_ids": tokens}, params, lora_request=lora,
                                          structured_prefix=tokens[prompt_len:]))
    except Exception:
        engine.abort_request(ids)
        raise
    return llm._run(ids, use_tqdm=False)
