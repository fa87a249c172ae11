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
