"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE): HF's router numerics in core, experts through the backend's
``fused_moe`` hook (one fused call per layer; ``ref_ops.fused_moe`` is the oracle).

Experts are stored stacked, as vLLM does: ``w13`` ``[E, 2I, H]`` (each expert's gate rows then up rows) and ``w2``
``[E, H, I]``; :func:`expert_tensor` builds them from the checkpoint's per-expert tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Router logits -> (float32 weights, int64 expert ids), each ``[T, top_k]``: softmax in float32, top-k, then
    renormalised to sum 1 when ``renormalize`` (Mixtral always; Qwen2-MoE as ``norm_topk_prob`` says)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class SparseMoeBlock(nn.Module):
    """Routed experts, plus (Qwen2-MoE) a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: Any, backend: Any, shared_expert: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        h = config.hidden_size
        e = getattr(config, "num_local_experts", None) or config.num_experts
        i = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        renorm = bool(getattr(config, "norm_topk_prob", True))  # Mixtral has no flag: it always renormalises
        self.gate = TopKRouter(h, e, config.num_experts_per_tok, renorm)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.fused_moe = backend.fused_moe
        if shared_expert is not None:
            self.shared_expert = shared_expert(config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.fused_moe(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class GroupedTopKRouter(nn.Module):
    """DeepSeek's router, HF's numerics (float32 throughout) -> (float32 weights, int64 ids), each ``[T, top_k]``.

    V2 (``topk_method``): softmax scores, top-k over all experts (``greedy``) or over the ``topk_group`` groups with
    the best max score (``group_limited_greedy``), never renormalised. V3 (``noaux_tc``): sigmoid scores; groups
    ranked by the sum of their top-2 ``scores + e_score_correction_bias``, experts chosen by the biased score,
    weighted by the unbiased one, renormalised when ``norm_topk_prob``. Both scale by ``routed_scaling_factor``."""

    def __init__(self, config: Any):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.v3 = config.model_type == "deepseek_v3"
        self.method = "noaux_tc" if self.v3 else getattr(config, "topk_method", "greedy")
        self.renormalize = self.v3 and bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size), requires_grad=False)
        if self.v3:
            self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts), requires_grad=False)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[T, E]`` bool: experts in the ``topk_group`` best groups."""
        best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(self.num_experts // self.n_group, dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        grouped = lambda s: s.view(-1, self.n_group, self.num_experts // self.n_group)  # noqa: E731
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            keep = self._group_mask(grouped(choice).topk(2, dim=-1)[0].sum(dim=-1))
            ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                scores = scores.masked_fill(~self._group_mask(grouped(scores).max(dim=-1).values), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return weights * self.scaling, ids


class DeepseekMoeBlock(nn.Module):
    """DeepSeek's MoE MLP: grouped routing, routed experts through ``fused_moe``, plus always-on shared experts."""

    def __init__(self, config: Any, backend: Any, shared_expert: Callable[[int], nn.Module]):
        super().__init__()
        h, e, i = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
        self.gate = GroupedTopKRouter(config)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.fused_moe = backend.fused_moe
        self.shared_experts = shared_expert(i * config.n_shared_experts) if config.n_shared_experts else None

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.fused_moe(x, self.w13, self.w2, weights, ids)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


def is_moe_layer(config: Any, layer: int) -> bool:
    """Which decoder layers are sparse, as HF decides (Qwen2/3-MoE: ``mlp_only_layers``, ``decoder_sparse_step``;
    Mixtral has neither: every layer). transformers 5 names Qwen3-MoE's expert count ``num_local_experts``."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return experts > 0 and layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


# Checkpoint names of an expert's (gate, up, down) projections, per layout.
_EXPERT_NAMES = {"block_sparse_moe": ("w1", "w3", "w2"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def expert_tensor(key: str, prefix: str, contains: Callable[[str], bool],
                  load: Callable[[str], torch.Tensor]) -> Optional[torch.Tensor]:
    """Our stacked ``layers.N.mlp.w13`` / ``w2`` (and the router ``mlp.gate.weight``) from HF per-expert tensors:
    ``mlp.experts.j.{gate,up,down}_proj`` (Qwen2-MoE) or ``block_sparse_moe.experts.j.w{1,3,2}`` (Mixtral).
    None when ``key`` is not an MoE parameter."""
    module, _, leaf = key.rpartition(".")
    layer, _, name = module.rpartition(".mlp")
    if name not in ("", ".gate") or leaf not in ("w13", "w2", "weight") or (name == "" and leaf == "weight"):
        return None
    for block, (g, u, d) in _EXPERT_NAMES.items():
        base = f"{prefix}{layer}.{block}"
        if name == ".gate" and contains(f"{base}.gate.weight"):
            return load(f"{base}.gate.weight")
        if name == "" and contains(f"{base}.experts.0.{d}.weight"):
            num_experts = 0
            while contains(f"{base}.experts.{num_experts}.{d}.weight"):
                num_experts += 1
            if leaf == "w2":
                return torch.stack([load(f"{base}.experts.{j}.{d}.weight") for j in range(num_experts)])
            return torch.stack([torch.cat([load(f"{base}.experts.{j}.{g}.weight"),
                                           load(f"{base}.experts.{j}.{u}.weight")]) for j in range(num_experts)])
    return None
