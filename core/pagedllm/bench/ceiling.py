"""Hardware ceilings to state beside measured rates: the GEMM-only time of a decode step, the weight bytes a step
streams (batch-1 decode cannot beat copy bandwidth / weight bytes), and the FLOPs of a step's linear layers (no GEMM
beats them / the bf16 peak, where the backend's op library measures one: ``matmul_peak``), and the KV cache a
workload's decode steps must read (no attention beats it / the streaming-read bandwidth).

The GEMM ceiling times the model's own linear layers (whatever kernel each runs on: packed dense, quantized, or
``F.linear``) and its LM head, at the step's batch size, on random activations: a decode step can go no faster
than that, since everything else (attention, norms, sampling, scheduling) comes on top.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Iterator

import torch
from torch import nn


def _linears(model: nn.Module) -> Iterator[tuple[int, Any]]:
    """(in_features, callable x -> y) for every linear layer, the LM head last."""
    for name, m in model.named_modules():
        if name == "lm_head":  # counted once, below, as the model computes logits
            continue
        if isinstance(m, nn.Linear) or hasattr(m, "kernel_name"):
            yield m.in_features, m
    head = getattr(model, "lm_head_kernel", None)
    if head is not None:
        apply, state = head
        yield model.hidden_size, lambda x: apply(state, x, None)
    else:
        w = model.lm_head_weight
        yield w.shape[1], lambda x: torch.nn.functional.linear(x, w)


def gemm_step_seconds(model: nn.Module, batch: int, repeats: int = 7, head_rows: int | None = None) -> float:
    """Median over repeats of the summed time of every linear layer at ``batch`` tokens and the LM head at
    ``head_rows`` (default ``batch``; a prefill step projects only each sequence's last token)."""
    layers = list(_linears(model))
    rows = [batch] * (len(layers) - 1) + [batch if head_rows is None else head_rows]
    xs = {(k, r): torch.randn(r, k, dtype=model.dtype, device=model.device) for (k, _), r in zip(layers, rows)}
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t = time.perf_counter()
            for (k, f), r in zip(layers, rows):
                f(xs[k, r])
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def linear_flops(model: nn.Module, batch: int) -> float:
    """Multiply-adds x 2 of one step's linear layers and LM head at ``batch`` tokens (a MoE's experts all counted:
    for MoE models it overstates a step)."""
    total = 0
    for name, m in model.named_modules():
        if name != "lm_head" and (isinstance(m, nn.Linear) or hasattr(m, "kernel_name")):
            total += m.in_features * m.out_features
    total += model.hidden_size * model.vocab_size
    return 2.0 * batch * total


def backend_op(backend_name: str, op: str) -> Any:
    """The backend's op ``op`` (``torch.ops.pagedllm_<backend>.<op>``), or None: looked up in torch's op registry,
    where the backend's library registered it, so the bench imports no plugin."""
    namespace = getattr(torch.ops, f"pagedllm_{backend_name.replace('-', '_')}")
    return getattr(namespace, op) if hasattr(namespace, op) else None


def matmul_peak_tflops(backend_name: str, seconds: float = 0.5) -> float | None:
    """The backend's ``matmul_peak(seconds) -> TFLOP/s`` op (its bf16 peak on all threads, 0 where it
    has none), or None where the backend registers no such op or measures 0."""
    op = backend_op(backend_name, "matmul_peak")
    return (float(op(seconds)) or None) if op is not None else None


def workload_flops(model: nn.Module, num_prompts: int, input_len: int, output_len: int) -> float:
    """FLOPs of the throughput workload's linear layers and LM head: every prompt and generated token but the last
    through the layers, the LM head on each prompt's last token and each decode token (``output_len`` a sequence)."""
    head = 2.0 * model.hidden_size * model.vocab_size
    layers = linear_flops(model, 1) - head
    return layers * num_prompts * (input_len + output_len - 1) + head * num_prompts * output_len


def decode_kv_read_bytes(kv_bytes_per_position: float, num_prompts: int, input_len: int, output_len: int) -> float:
    """Bytes of KV cache the throughput workload's decode steps read: the step that makes a sequence's token
    ``k + 1`` attends over its ``input_len + k`` positions, every layer's keys and values (``kv_bytes_per_position``,
    all layers). A lower bound on the attention's traffic: the prefill's is left out."""
    positions = (output_len - 1) * input_len + (output_len - 1) * output_len // 2
    return kv_bytes_per_position * num_prompts * positions


def gemm_workload_seconds(model: nn.Module, num_prompts: int, input_len: int, output_len: int,
                          max_batched_tokens: int) -> tuple[float, float]:
    """(prefill, decode) seconds of the GEMMs alone for the throughput workload: the prompts' tokens in chunks of
    the scheduler's token budget (LM head on the sequences each chunk completes), then ``output_len - 1`` decode
    steps of ``num_prompts`` tokens. No engine of the same precision can run the workload in less time on these
    kernels; the ratio of a measured run to their sum is its share spent outside the GEMMs."""
    per_chunk = max(1, max_batched_tokens // input_len)  # whole prompts per chunk (the workload's prompts are equal)
    prefill, left = 0.0, num_prompts
    while left:
        n = min(per_chunk, left)
        prefill += gemm_step_seconds(model, n * input_len, repeats=3, head_rows=n)
        left -= n
    return prefill, (output_len - 1) * gemm_step_seconds(model, num_prompts)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors of a kernel's state: a tensor, tuples / lists of them, or a dataclass's fields (a backend's
    state record, e.g. the CPU Q4 kernels' packed blocks; missed before, the 135M Q4_1 model counted only its head)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear layer (in its kernel's layout) and the LM head."""
    seen, total = set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for name, m in model.named_modules():
        if name == "lm_head":  # counted once, below, as the model computes logits
            continue
        if isinstance(m, nn.Linear):
            add(m.weight)
        for t in _tensors(getattr(m, "state", None)):
            add(t)
        if getattr(m, "bias", None) is not None and isinstance(m.bias, torch.Tensor):
            add(m.bias)
    head = getattr(model, "lm_head_kernel", None)
    for t in (_tensors(head[1]) if head is not None else [model.lm_head_weight]):
        add(t)
    return total
