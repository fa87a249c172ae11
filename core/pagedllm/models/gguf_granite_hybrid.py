"""Granite-4.0-H GGUF (arch ``granitehybrid``, llama.cpp's ``GraniteHybridModel`` over ``Mamba2Model`` and
``GraniteMoeModel``) read back as HF's ``GraniteMoeHybridForCausalLM`` for ``models/granite_hybrid.py``.

transformers builds no config for the arch, so :func:`granite_hybrid_config` builds it from the metadata, read as
llama.cpp's ``llama_model_granite_hybrid`` reads it:

- a layer is Mamba2 where its ``attention.head_count_kv`` entry is 0, attention otherwise (one KV head count for all
  attention layers, as HF's config has);
- ``ssm.inner_size`` (2 x hidden: llama.cpp asserts it), ``ssm.time_step_rank`` (the Mamba2 heads, head size
  inner / heads), ``ssm.group_count``, ``ssm.state_size``, ``ssm.conv_kernel``; conv and projection biases from the
  tensors; the SSD chunk size is not written (HF's default 256: numerics only);
- Granite's multipliers under llama.cpp's names: ``attention.scale`` (absent: ``head_dim ** -0.5``),
  ``embedding_scale``, ``residual_scale``, ``logit_scale`` (absent: 1, as llama.cpp skips them);
- rotary only when ``rope.scaling.finetuned`` is true (llama.cpp's switch, default true): the converter writes false
  for every Granite-4.0-H (and its arbitrary 2^20 ``context_length``), whatever ``position_embedding_type`` the
  checkpoint said, so such a file runs without rotary as llama.cpp runs it; a partial ``rope.dimension_count`` is
  refused (Bamba's, which this module does not run);
- routed experts from ``expert_count`` / ``expert_used_count`` (softmax over the top-k logits, as llama.cpp's
  renormalised softmax gating), the shared MLP from ``expert_shared_feed_forward_length``; a dense file
  (Granite-4.0-H-micro: no experts) has its shared MLP as the plain ``ffn_*`` of width ``feed_forward_length``.

A key llama.cpp requires, or one whose absence would change the model, is refused naming it.

:class:`GraniteHybridLayout` undoes the tensor transforms (``gguf_weights.GGUFWeights``):

- Mamba2 layers as ``Mamba2Model`` writes them (``gguf_ssm``: ``A = -exp(A_log)``, ``D`` and the gated norm
  reshaped, the conv squeezed, ``dt_bias`` renamed ``dt_proj.bias``);
- attention q/k rows permuted as ``LlamaModel.permute`` does (``undo_permute = True``; harmless to a run without
  rotary, undone so the weights are the checkpoint's) -- by ``gguf_weights``' Llama row order;
- the fused ``block_sparse_moe.input_linear`` ``[E, 2I, H]`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` and
  ``shared_mlp.input_linear`` ``[2S, H]`` into ``ffn_gate_shexp`` / ``ffn_up_shexp`` (dense: ``ffn_gate`` /
  ``ffn_up``, with ``shared_mlp.output_linear`` as ``ffn_down``): concatenated back (gate rows, then up rows).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np

from pagedllm.models.gguf_ssm import (converter_name as mamba2_converter_name,
    undo_converter as mamba2_undo)

ARCH = "granitehybrid"

_LAYER = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(input_linear|output_linear)\.weight")


def granite_hybrid_config(path: str, meta: dict, shapes: dict[str, tuple[int, ...]]) -> Any:
    """``GraniteMoeHybridConfig`` of the ``granitehybrid`` GGUF at ``path`` (``meta``: its scalar metadata,
    ``shapes``: its tensor shapes innermost first)."""
    from transformers import GraniteMoeHybridConfig  # heavy: transformers

    def k(key: str) -> Any:
        if f"{ARCH}.{key}" not in meta:
            raise ValueError(f"GGUF file {path} lacks metadata key {f'{ARCH}.{key}'!r}")
        return meta[f"{ARCH}.{key}"]

    def refuse(key: str, why: str) -> ValueError:
        return ValueError(f"{ARCH} GGUF file {path}: {ARCH}.{key} {why}")

    hidden, layers, heads = int(k("embedding_length")), int(k("block_count")), int(k("attention.head_count"))
    kv = k("attention.head_count_kv")
    kv = [int(kv)] * layers if np.isscalar(kv) else [int(n) for n in kv]
    if len(kv) != layers:
        raise refuse("attention.head_count_kv", f"has {len(kv)} entries for {layers} blocks")
    kv_heads = sorted({n for n in kv if n})
    if len(kv_heads) > 1:
        raise refuse("attention.head_count_kv", f"{kv}: attention layers with different KV head counts")
    inner, ssm_heads = int(k("ssm.inner_size")), int(k("ssm.time_step_rank"))
    if inner != 2 * hidden:
        raise refuse("ssm.inner_size", f"{inner} is not 2 x embedding_length {hidden} (llama.cpp's requirement)")
    if inner % ssm_heads:
        raise refuse("ssm.time_step_rank", f"{ssm_heads} does not divide ssm.inner_size {inner}")
    head_dim = hidden // heads
    rope = bool(meta.get(f"{ARCH}.rope.scaling.finetuned", True))
    if rope and int(meta.get(f"{ARCH}.rope.dimension_count", head_dim)) != head_dim:
        raise refuse("rope.dimension_count", f"{meta[f'{ARCH}.rope.dimension_count']}: partial rotary (Bamba) is "
                     f"not run (head size {head_dim})")
    experts = int(meta.get(f"{ARCH}.expert_count", 0))
    ffn = int(k("feed_forward_length"))
    layer_types = ["linear_attention" if n == 0 else "full_attention" for n in kv]
    first = {t: layer_types.index(t) for t in set(layer_types)}
    ssm, attn = first.get("linear_attention"), first.get("full_attention")
    return GraniteMoeHybridConfig(
        vocab_size=int(shapes["token_embd.weight"][1]), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads[0] if kv_heads else heads,
        intermediate_size=ffn, num_local_experts=experts,
        num_experts_per_tok=int(k("expert_used_count")) if experts else 0,
        shared_intermediate_size=int(k("expert_shared_feed_forward_length")) if experts else ffn,
        layer_types=layer_types, mamba_n_heads=ssm_heads, mamba_d_head=inner // ssm_heads,
        mamba_n_groups=int(k("ssm.group_count")), mamba_d_state=int(k("ssm.state_size")),
        mamba_d_conv=int(k("ssm.conv_kernel")), mamba_expand=inner // hidden,
        mamba_conv_bias=ssm is not None and f"blk.{ssm}.ssm_conv1d.bias" in shapes,
        mamba_proj_bias=ssm is not None and f"blk.{ssm}.ssm_in.bias" in shapes,
        attention_bias=attn is not None and f"blk.{attn}.attn_q.bias" in shapes,
        rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        attention_multiplier=float(meta.get(f"{ARCH}.attention.scale", 0.0) or head_dim ** -0.5),
        embedding_multiplier=float(meta.get(f"{ARCH}.embedding_scale", 0.0) or 1.0),
        residual_multiplier=float(meta.get(f"{ARCH}.residual_scale", 0.0) or 1.0),
        logits_scaling=float(meta.get(f"{ARCH}.logit_scale", 0.0) or 1.0),
        position_embedding_type="rope" if rope else None,
        rope_parameters=dict(rope_type="default", rope_theta=float(meta.get(f"{ARCH}.rope.freq_base", 10000.0))),
        max_position_embeddings=int(k("context_length")), hidden_act="silu",
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), architectures=["GraniteMoeHybridForCausalLM"])


class GraniteHybridLayout:
    """The converter's renames and splits for one file (``has``: whether the file holds a GGUF tensor name)."""

    def __init__(self, has: Callable[[str], bool]):
        self.has = has

    def _dense(self, layer: str) -> bool:
        """A layer whose shared MLP the converter wrote as the plain FFN (no routed experts in the file)."""
        return not self.has(f"blk.{layer}.ffn_gate_inp.weight")

    def parts(self, hf_name: str) -> Optional[tuple[list[str], int]]:
        """(GGUF tensors whose rows, concatenated along ``axis``, make ``hf_name``, axis of the numpy data) for the
        fused ``input_linear`` tensors; None for every other tensor."""
        m = _LAYER.fullmatch(hf_name)
        if m is None or m[3] != "input_linear":
            return None
        layer = m[1]
        if m[2] == "block_sparse_moe":  # [E, I, H] each: gate rows then up rows of every expert
            return [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up")], 1
        suffix = "" if self._dense(layer) else "_shexp"
        return [f"blk.{layer}.ffn_{p}{suffix}.weight" for p in ("gate", "up")], 0

    def gguf_name(self, hf_name: str) -> Optional[str]:
        """The file's name for a tensor the name map would miss or misname (a dense file's shared-MLP output)."""
        m = _LAYER.fullmatch(hf_name)
        if m is not None and m[2] == "shared_mlp" and m[3] == "output_linear" and self._dense(m[1]):
            return f"blk.{m[1]}.ffn_down.weight"
        return None

    @staticmethod
    def converter_name(hf_name: str) -> str:
        """The HF name the converter passed to gguf's name map (``dt_bias`` became ``dt_proj.bias``)."""
        return mamba2_converter_name("mamba2", hf_name)

    @staticmethod
    def undo(gguf_name: str, data: np.ndarray) -> Optional[np.ndarray]:
        """``data`` with ``Mamba2Model``'s value and shape transforms undone (None: left as the file holds it)."""
        return mamba2_undo("mamba2", gguf_name, data)
