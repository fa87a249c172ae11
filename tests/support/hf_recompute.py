"""HF greedy tokens without HF's cache: the whole sequence recomputed each step. The oracle for models whose HF
decode cache a plain ``past_key_values`` loop does not reach (Mamba2's state: tests/models/test_mamba2.py)."""

from __future__ import annotations

import functools

import torch

from engine_parity import hf_model


@functools.lru_cache(maxsize=None)
def hf_greedy_recompute(path: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt`` from the float32 HF model in ``path``."""
    model, ids = hf_model(path), []
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([list(prompt) + ids])).logits[0, -1].argmax()))
    return ids
