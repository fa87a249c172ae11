"""HF transformers as the oracle: greedy decoding by plain argmax over its own KV cache (no logits processors)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt``; EOS is not special here (the engine runs with ignore_eos)."""
    out_ids = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids


def hf_greedy_processed(model, prompt: list[int], n: int, processors: list) -> list[int]:
    """Like :func:`hf_greedy`, with HF ``LogitsProcessor`` objects applied to each step's logits first (the oracle
    for logit_bias, allowed_token_ids and bad_words)."""
    ids = list(prompt)
    out_ids = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            scores = out.logits[:, -1].float()
            for p in processors:
                scores = p(torch.tensor([ids]), scores)
            tok = int(scores[0].argmax())
            out_ids.append(tok)
            ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids
