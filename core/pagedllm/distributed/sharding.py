"""Load-time sharding: the model of one rank of a ``tp x pp`` engine.

Three steps around the ordinary loader (``models/loader.py``): :func:`local_config` shrinks the HF config to this
rank's heads and MLP columns, so ``CausalLM`` builds its attention and MLP at the local sizes; :func:`parallelize`
swaps in the layers that communicate (row-parallel ``o_proj`` / ``down_proj``, vocab-parallel embedding and LM head)
and drops the decoder layers other pipeline stages own; :func:`shard_state_dict` slices the full checkpoint tensors
to what this rank holds. Attention heads are split by head (q, k and v of the fused ``qkv_proj`` each by its own
heads); with fewer kv heads than ranks each kv head is replicated on the ``tp / num_kv_heads`` ranks whose query
heads read it (GQA).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.layers import (ExpertParallelMoE, LogitsGather, PPMissingLayer, RowParallelLinear,
                                        VocabParallelEmbedding)
from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.errors import ParamError


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split, the remainder to the first stages."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (pp_rank < extra)


def num_experts(config: Any) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


def expert_range(num: int, tp: int, rank: int) -> tuple[int, int]:
    """Experts ``[start, end)`` of tensor rank ``rank``: an even split, the remainder to the first ranks."""
    return pp_layer_range(num, tp, rank)


def check_shardable(config: Any, tp: int, pp: int, expert_parallel: bool = False) -> None:
    """Raise ParamError naming the size that does not divide the model."""
    if num_experts(config) and tp > 1 and not expert_parallel:
        raise ParamError("tensor_parallel_size", "a mixture-of-experts model splits its experts across the "
                                                 "tensor-parallel ranks: add --enable-expert-parallel")
    if expert_parallel and (tp == 1 or not num_experts(config)):
        raise ParamError("enable_expert_parallel", "needs tensor_parallel_size > 1 and a mixture-of-experts model")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ParamError("tensor_parallel_size", f"{tp} does not divide the model's {heads} attention heads")
    if kv % tp and tp % kv:
        raise ParamError("tensor_parallel_size", f"{tp} and the model's {kv} kv heads: one must divide the other")
    if config.intermediate_size % tp:
        raise ParamError("tensor_parallel_size", f"{tp} does not divide intermediate_size {config.intermediate_size}")
    if pp > config.num_hidden_layers:
        raise ParamError("pipeline_parallel_size", f"{pp} stages for {config.num_hidden_layers} layers")


def local_config(config: Any, par: ParallelState) -> Any:
    """A copy of ``config`` with this rank's head counts and MLP width (head size pinned first)."""
    tp = par.tp_size
    if tp == 1:
        return config
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local.num_attention_heads = config.num_attention_heads // tp
    local.num_key_value_heads = max(1, config.num_key_value_heads // tp)
    if num_experts(config):  # expert parallel: each expert stays whole (its rank has it all)
        local.moe_intermediate_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    local.intermediate_size = config.intermediate_size // tp
    return local


def _vocab_per_rank(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def parallelize(model: Any, full_config: Any, par: ParallelState) -> None:
    """Swap the communicating layers into ``model`` (built from :func:`local_config`, on the meta device)."""
    tp, comm = par.tp_size, par.tp_group
    start, end = pp_layer_range(len(model.layers), par.pp_size, par.pp_rank)
    for i, layer in enumerate(model.layers):
        if not start <= i < end:
            model.layers[i] = PPMissingLayer()
            continue
        if tp == 1:
            continue
        o = layer.self_attn.o_proj
        layer.self_attn.o_proj = RowParallelLinear(o.in_features, o.out_features, o.bias is not None, comm)
        mlp = layer.mlp
        if hasattr(mlp, "w13"):  # a sparse MoE block: expert parallel
            e0, e1 = expert_range(mlp.w13.shape[0], tp, par.tp_rank)
            mlp.w13 = nn.Parameter(torch.empty(e1 - e0, *mlp.w13.shape[1:]), requires_grad=False)
            mlp.w2 = nn.Parameter(torch.empty(e1 - e0, *mlp.w2.shape[1:]), requires_grad=False)
            mlp.fused_moe = ExpertParallelMoE(mlp.fused_moe, e0, e1 - e0, comm)
        else:
            d = mlp.down_proj
            mlp.down_proj = RowParallelLinear(d.in_features, d.out_features, d.bias is not None, comm)
    model.start_layer, model.end_layer = start, end
    model.num_layers = end - start  # the KV pool holds this stage's layers only
    if tp > 1:
        per = _vocab_per_rank(full_config.vocab_size, tp)
        model.embed_tokens = VocabParallelEmbedding(per, full_config.hidden_size, par.tp_rank, comm)
        if not model.tie_word_embeddings:
            model.lm_head = torch.nn.Linear(full_config.hidden_size, per, bias=False)
        model.logits_gather = LogitsGather(full_config.vocab_size, comm)


def shard_state_dict(sd: dict[str, torch.Tensor], full_config: Any, par: ParallelState) -> dict[str, torch.Tensor]:
    """Slice every full tensor of ``sd`` (keys of the parallelized model) to this rank's part."""
    tp, r = par.tp_size, par.tp_rank
    if tp == 1:
        return sd
    heads, kv = full_config.num_attention_heads, full_config.num_key_value_heads
    d = getattr(full_config, "head_dim", None) or full_config.hidden_size // heads
    inter = full_config.intermediate_size
    q_rows = slice(r * heads // tp * d, (r + 1) * heads // tp * d)
    kv_first = r * kv // tp  # first kv head of this rank (the one it replicates when kv < tp)
    kv_n = max(1, kv // tp)
    k_rows = slice(kv_first * d, (kv_first + kv_n) * d)
    i_rows = slice(r * inter // tp, (r + 1) * inter // tp)
    out: dict[str, torch.Tensor] = {}
    for key, full in sd.items():
        module, _, leaf = key.rpartition(".")
        t = full
        if module.endswith("self_attn.qkv_proj"):
            q, k, v = t.split([heads * d, kv * d, kv * d], dim=0)
            t = torch.cat([q[q_rows], k[k_rows], v[k_rows]], dim=0)
        elif module.endswith("self_attn.o_proj") and leaf == "weight":
            t = t[:, q_rows]
        elif module.endswith("mlp.gate_up_proj"):
            gate, up = t.split([inter, inter], dim=0)
            t = torch.cat([gate[i_rows], up[i_rows]], dim=0)
        elif module.endswith("mlp.down_proj") and leaf == "weight":
            t = t[:, i_rows]
        elif key.endswith((".mlp.w13", ".mlp.w2")):
            e0, e1 = expert_range(t.shape[0], tp, r)
            t = t[e0:e1]
        elif key in ("embed_tokens.weight", "lm_head.weight"):
            per = _vocab_per_rank(full_config.vocab_size, tp)
            part = t[r * per:(r + 1) * per]
            t = torch.cat([part, part.new_zeros(per - part.shape[0], part.shape[1])]) if part.shape[0] < per else part
        out[key] = t if t is full else t.contiguous().clone()  # a copy: the full tensor is freed
    return out
