"""Output processing: turn sampled tokens into request state (logprobs, stop checks, incremental text) and group
the ``n`` samples of a request into one ``RequestOutput``."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sample.sampler import logprob_entries
from pagedllm.sampling_params import SamplingParams


class ParentRequest:
    """Groups the ``n`` (or ``best_of``) samples of one user request."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.children: list[Request] = []
        self.detoks: dict[str, Optional[IncrementalDetokenizer]] = {}
        self.sent: dict[str, tuple[int, int, int]] = {}  # delta outputs: tokens, text chars, logprobs already out
        self.prompt_sent = False  # delta outputs carry the prompt fields once

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        children = self.children
        ranked = self.params.best_of > self.params.n  # best_of: the n best by cumulative logprob, at the end
        if ranked:
            if not self.finished:
                children = []
            else:
                children = sorted(children, key=lambda c: -c.cumulative_logprob)[: self.params.n]
        delta = self.params.output_kind == "delta"
        outs = []
        for i, c in enumerate(children):
            nt = nx = nl = 0
            if delta:  # the detokenizer's text only grows, so new text is a suffix
                nt, nx, nl = self.sent.get(c.request_id, (0, 0, 0))
                self.sent[c.request_id] = (len(c.output_token_ids), len(c.output_text),
                                           len(c.logprobs) if c.logprobs is not None else 0)
            outs.append(CompletionOutput(  # slices: copies of the (new) part, one per output
                index=c.index if self.params.best_of == self.params.n else i,
                text=c.output_text[nx:], token_ids=c.output_token_ids[nt:],
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None or ranked else None,
                logprobs=c.logprobs[nl:] if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        first = self.children[0]
        metrics = {"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                   "last_token_time": max((c.last_token_time or 0.0) for c in self.children) or None}
        if delta and self.prompt_sent:
            return RequestOutput(self.request_id, None, [], outs, self.finished,
                                 num_cached_tokens=first.num_cached_tokens, metrics=metrics,
                                 kv_transfer_params=first.kv_transfer_params if self.finished else None)
        self.prompt_sent = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens,
                             metrics=metrics, kv_transfer_params=first.kv_transfer_params if self.finished else None)


class OutputProcessor:
    """Per-token bookkeeping after sampling; decides *whether* a request finishes (the scheduler frees it)."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # token id -> its text alone (``decode([id])``): large-n logprobs name ~n * 21 tokens a step, mostly repeats
        self._token_text: dict[int, str] = {}

    def _name_tokens(self, entries: dict[int, Logprob], params: SamplingParams) -> None:
        if self.tokenizer is not None and params.detokenize:
            names = self._token_text
            for tid, lp in entries.items():
                name = names.get(tid)
                if name is None:
                    name = names[tid] = self.tokenizer.decode([tid])
                lp.decoded_token = name

    def record_prompt_logprobs(self, req: Request, first: int, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens first+1.. under those positions' raw logits: the token plus the top-N."""
        lps = logits.log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first + 1:first + 1 + lps.shape[0]], dtype=torch.long)
        for d in logprob_entries(lps, targets, [req.params.prompt_logprobs] * len(targets)):
            self._name_tokens(d, req.params)
            req.prompt_logprobs.append(d)

    def process_token(self, parent: ParentRequest, req: Request, token: int,
                      logprobs: Optional[dict[int, Logprob]], logprob: float, now: float,
                      grammar_done: bool = False) -> Optional[RequestStatus]:
        """Append one sampled token; returns the finish status when this token ends the request (``grammar_done``:
        the request's grammar accepts nothing more, so it stops even without EOS)."""
        req.append_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        req.cumulative_logprob += logprob
        params = req.params
        if req.logprobs is not None and logprobs is not None:
            self._name_tokens(logprobs, params)
            req.logprobs.append(logprobs)
        status = None
        if token in params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif not params.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif grammar_done:
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        detok = parent.detoks.get(req.request_id)
        if detok is not None:
            # EOS / stop-token text is not part of the output (as in vLLM); skip_special_tokens hides it anyway.
            by_token = status == RequestStatus.FINISHED_STOPPED and not (grammar_done and req.stop_reason is None
                                                                         and token not in req.eos_token_ids)
            _, stop_str = detok.update([token], stop_terminated=by_token)
            if stop_str is not None and req.num_output_tokens >= params.min_tokens:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            elif status is not None:
                detok.finish()
            # While running, expose only text that can no longer turn into a stop string (as vLLM does).
            req.output_text = detok.output_text if status is not None else detok.emitted_text
        return status
