"""Pure-decode steps of GGUF Llama-family models run their decoder layers in one C++ call (``csrc/decode_layers.cpp``).

At batch 1 on CPU the interpreter is a large share of a small model's step: the embedded SmolLM2-135M Q4_1 spent ~3 ms
of an ~8 ms step in Python and the dispatcher (``perf``, AMD EPYC AVX-512; docs/benchmarks.md) around ~5 ms of
kernels. ``DecodeLayers`` calls the very ops the eager layers call, in their order, on the same weights, so a step's
hidden states are the eager ones bit for bit (a test holds both paths to that); only the Python between the ops goes.

It takes what it can prove it computes the same: a plain decoder as core describes one
(``pagedllm.backend.plain_decoder_layers``: Llama layers without q/k norms, ALiBi, sinks, soft-capping or GeGLU) whose
linears are this backend's GGUF block kernels (Q4_0 / Q4_1, Q8_0, Q4_K / Q5_K / Q6_K; a Q4_K_M's mixed qkv as
its parts) on their fp32-activation path, or on their int8-activation one for the calls the eager path sends there
(``PAGEDLLM_CPU_INT8_ACT=1``), and a step of decodes only without LoRA, KV groups or a KV connector. Any other model
or step runs eager, as does everything under ``enforce_eager``.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from pagedllm_cpu import native, quant
from pagedllm_cpu.ops import _NATIVE_DTYPES

if TYPE_CHECKING:
    from pagedllm.backend import PlainLinear

logger = logging.getLogger(__name__)

_Q4, _Q8, _KQUANT, _KQUANT_R16 = 0, 1, 2, 3  # csrc/decode_layers.cpp's part kinds
_KERNELS = (quant.Q4.name, quant.Q8.name, quant.KQUANT.name)


def ineligible(model: Any) -> Optional[str]:
    """Why ``model``'s layers cannot run as ``DecodeLayers`` (core's ``plain_decoder_layers`` and this backend's
    GGUF block kernels; the kernels' dispatch is checked at build), or None."""
    from pagedllm.backend import plain_decoder_layers  # (core's models: imported when a model runs, not at discovery)

    layers, why = plain_decoder_layers(model)
    if layers is None:
        return why
    for layer in layers:
        if any(p.kernel not in _KERNELS for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) for p in lin.parts):
            return "a linear that is not a GGUF block kernel of this backend"
    return None


def _add_linear(plan: Any, site: int, lin: PlainLinear, dtype: torch.dtype) -> float:
    """Adds ``lin``'s parts to the plan's last layer, each with the rows of x up to which its eager path takes int8
    activations (``quant.fp32_rows``); returns the rows from which that path is a bf16 GEMM instead."""
    limit = math.inf
    for p in lin.parts:
        int8_rows, bf16_rows = quant.fp32_rows(p.kernel, p.state, dtype)
        st = p.state
        if p.kernel == quant.Q4.name:
            plan.add_part(site, _Q4, st.packed, st.n, st.has_min, "", -1, -1, int8_rows, p.bias, lin.joined)
        elif p.kernel == quant.Q8.name:
            plan.add_part(site, _Q8, st, 0, False, "", -1, -1, int8_rows, p.bias, lin.joined)
        else:
            blocks, weight_type, isa, r16 = st[0], st[1], st[2], st[5]
            plan.add_part(site, _KQUANT_R16 if r16 else _KQUANT, blocks, 0, False, weight_type,
                          quant.kquant_fp32_isa(isa), isa, int8_rows, p.bias, lin.joined)
        limit = min(limit, bf16_rows if bf16_rows is not None else math.inf)
    if lin.bias is not None:
        plan.set_bias(site, lin.bias)
    return limit


def build(model: Any) -> tuple[Optional[Any], float]:
    """(``DecodeLayers`` over ``model``'s layers, the rows of x below which every linear's eager path is its fp32
    kernel), or (None, 0) where the ops would differ from the eager ones: another dtype than the C++ ops take, a
    cache in another dtype (fp8) or layout, a norm weight in another dtype or layout, or no library (or no caches
    yet)."""
    from pagedllm.backend import plain_decoder_layers

    dtype = model.dtype
    layers, _ = plain_decoder_layers(model)
    if (layers is None or native.lib is None or dtype not in _NATIVE_DTYPES or not model.kv_caches
            or model.cos_sin_cache.dtype not in (torch.float32, dtype)
            or not all(c.is_contiguous() and c.dtype == dtype for c in model.kv_caches)):
        return None, 0
    plan = torch.classes.pagedllm_cpu.DecodeLayers()
    limit = math.inf
    try:
        for layer in layers:
            for w in (layer.input_norm, layer.post_attention_norm):
                if w.dtype != dtype or not w.is_contiguous():
                    raise ValueError("a norm weight in another dtype or layout")
            plan.add_layer(layer.input_norm, layer.input_eps, layer.post_attention_norm, layer.post_attention_eps,
                           layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale,
                           layer.sliding_window or 0)
            for site, lin in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
                limit = min(limit, _add_linear(plan, site, lin, dtype))
    except ValueError as e:
        logger.info("decoder layers run eager (%s)", e)
        return None, 0
    return plan, limit


class DecodeRunner:
    """The graph runner's ``run``: a step of decodes only goes through ``DecodeLayers`` (built on the first step
    after the library is loaded), any other step through the model."""

    def __init__(self, model: Any, stats: dict):
        self.model = model
        self.stats = stats  # the GraphRunner's: ``decode_layers_steps`` counts the steps that took the C++ call
        self.plan: Optional[Any] = None
        self.max_rows = 0.0  # a step takes the plan below this many rows (``build``)
        self.tried = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        if not self.tried and native.lib is not None:
            self.tried = True
            self.plan, self.max_rows = build(self.model)
        m = self.model
        t = input_ids.shape[0]
        if (self.plan is None or meta.num_decodes != t or t >= self.max_rows or meta.lora_mapping is not None
                or meta.kv_group_tables is not None or meta.kv_connector is not None):
            return m(input_ids, positions, meta)
        h = self.plan.forward(m.embed_tokens(input_ids), positions, meta.slot_mapping, meta.block_tables,
                              meta.seq_lens, m.kv_caches, m.cos_sin_cache)
        self.stats["decode_layers_steps"] += 1
        return m.norm(h)
