"""GPT-OSS's MoE MLP (what differs from the shared decoder; attention sinks and alternating windows are
``ArchSpec(sinks=True, sliding="layer_types")`` in ``causal_lm``).

The router is a linear layer with a bias; it picks the top-k *logits*, then softmaxes over those k. Each expert has
biases and the clamped SwiGLU of transformers' ``GptOssExperts``: gate and up are the even and odd columns of
``gate_up_proj`` (interleaved), ``gate.clamp(max=limit)``, ``up.clamp(-limit, limit)``, ``(up + 1) * gate *
sigmoid(alpha * gate)``. The backend's ``fused_moe`` hook has neither biases nor this activation, so the experts run
here in torch (tokens grouped per expert, one matmul each). Parameters keep the checkpoint's names and layouts
(``mlp.router.{weight,bias}``, ``mlp.experts.{gate_up_proj,down_proj}[_bias]``): the loader maps them one to one.

MXFP4 checkpoints (the published gpt-oss weights: experts as ``*_blocks`` / ``*_scales``) load dequantized
(:class:`Mxfp4Weights`, with transformers' own ``convert_moe_packed_tensors``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class GptOssRouter(nn.Module):
    """Router logits (with bias) -> (float32 weights, int64 expert ids) ``[T, top_k]``: top-k of the logits, softmax
    over the k (HF's order; the softmax runs in the logits' dtype, as HF's)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return torch.softmax(values, dim=-1).float(), ids


class GptOssExperts(nn.Module):
    """Stacked experts in the checkpoint's layout: ``gate_up_proj`` ``[E, H, 2I]`` (gate, up interleaved along the
    last dim), ``down_proj`` ``[E, I, H]``, and their biases."""

    def __init__(self, config: Any):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, i, h), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, routing ``[T, k]`` -> ``sum_k weights * expert_k(x)`` ``[T, H]`` in x's dtype."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens = order // ids.shape[1]
        w = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            h = x[rows] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self.activation(h) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, rows, (y * w[start:start + n, None]).to(x.dtype))
            start += n
        return out


class GptOssMoeBlock(nn.Module):
    """``mlp``: router then experts (every GPT-OSS layer is sparse)."""

    def __init__(self, config: Any):
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


def is_mxfp4_checkpoint(config: Any) -> bool:
    """A GPT-OSS checkpoint whose experts are MXFP4 (``quantization_config.quant_method == "mxfp4"``)."""
    qc = getattr(config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) or qc is None else qc.to_dict()
    return getattr(config, "model_type", None) == "gpt_oss" and (qc or {}).get("quant_method") == "mxfp4"


#: The expert tensors an MXFP4 checkpoint stores as ``<name>_blocks`` (uint8, two e2m1 values a byte, 32 a block)
#: and ``<name>_scales`` (uint8 exponents, bias 127).
_MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


class Mxfp4Weights:
    """A weight source over an MXFP4 GPT-OSS checkpoint: ``mlp.experts.{gate_up_proj,down_proj}`` come back
    dequantized in the checkpoint's dense layout (bfloat16 holds every e2m1 value times its power-of-two scale
    exactly; the loader then casts to the model dtype). Costs the dense experts' memory: MXFP4 is not kept packed."""

    def __init__(self, source: Any):
        self.source = source

    def _packed(self, name: str) -> bool:
        return (name.endswith(_MXFP4_TENSORS) and name not in self.source and f"{name}_blocks" in self.source
                and f"{name}_scales" in self.source)

    def __contains__(self, name: str) -> bool:
        return name in self.source or self._packed(name)

    def take(self, name: str) -> torch.Tensor:
        if not self._packed(name):
            return self.source.take(name)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # heavy: transformers

        return convert_moe_packed_tensors(self.source.take(f"{name}_blocks"), self.source.take(f"{name}_scales"),
                                          dtype=torch.bfloat16)
