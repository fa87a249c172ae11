"""GPT-OSS GGUF (arch ``gpt-oss``, llama.cpp's ``GptOssModel``) read back as HF's ``GptOssForCausalLM`` for the
native decoder (``models/gpt_oss.py``: sinks, alternating windows, biased router, clamped SwiGLU experts).

transformers' GGUF reader half-maps the arch (no windows per layer, no expert width, its rope keys misread), so
:func:`gpt_oss_config` builds the config from the metadata, read as llama.cpp's ``llama_model_openai_moe`` reads it:

- ``expert_feed_forward_length`` is the expert width (``intermediate_size``), ``expert_count`` /
  ``expert_used_count`` the experts (top-k of the biased router's logits, softmax over the k: llama.cpp's
  ``SOFTMAX_WEIGHT`` gating), ``attention.sliding_window`` the window, all required as llama.cpp requires them;
- the sliding layers from ``attention.sliding_window_pattern`` when the file has it (a per-layer bool array, or a
  period n: layer i slides when ``i % n < n - 1``), else llama.cpp's default period 2, sliding first -- GPT-OSS's own
  ``layer_types``. The converter writes no pattern, so a checkpoint whose ``layer_types`` differ from that default
  becomes a file that llama.cpp (and this) runs with the default;
- the head size from ``attention.key_length`` (``value_length`` must equal it), full rotary (a smaller
  ``rope.dimension_count`` is refused);
- rope: ``rope.freq_base`` (llama.cpp's default 10000 when absent), YaRN from ``rope.scaling.type`` / ``factor`` /
  ``original_context_length`` / ``yarn_beta_fast`` / ``yarn_beta_slow`` (HF's 32 / 1 when absent). The converter
  drops HF's ``truncate``; every released GPT-OSS config says ``truncate: false``, so the file runs with it (HF's
  numerics on the source checkpoint; llama.cpp's ggml rounds the correction range to whole dims instead).
  ``yarn_attn_factor`` / ``yarn_ext_factor`` other than 1, or ``yarn_log_multiplier``, are refused (not mapped);
- the clamped SwiGLU's ``alpha`` 1.702 and ``limit`` 7.0: llama.cpp's constants (not in the file).

A key llama.cpp requires is refused naming it when missing.

:class:`GptOssLayout` undoes ``GptOssModel.modify_tensors``:

- ``self_attn.sinks`` was renamed ``sinks.weight`` (``blk.N.attn_sinks.weight``);
- ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (gate and up interleaved along the last dim) was transposed and split
  ``[:, ::2]`` / ``[:, 1::2]`` into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``, its bias ``[E, 2I]`` into
  ``ffn_{gate,up}_exps.bias`` ``[E, I]``: transposed back and re-interleaved;
- ``mlp.experts.down_proj`` ``[E, I, H]`` was transposed (``ffn_down_exps`` ``[E, H, I]``): transposed back; its bias
  is ``ffn_down_exps.bias`` as it was;
- MXFP4 checkpoints' ``*_blocks`` / ``*_scales`` were repacked to ggml's MXFP4 in the same ``[E, I, H]`` /
  ``[E, H, I]`` layouts. Expert tensors of any type (MXFP4, Q8_0, F16, BF16, F32) load **dequantized** by
  ``gguf.quants``: the experts run in torch (no kernel takes them), so they cost their dense size (logged at load).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

ARCH = "gpt-oss"

#: llama.cpp's ``LLM_FFN_SWIGLU_OAI_MOE`` constants (``llama-graph.cpp``), which the file does not carry.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0

_EXPERTS = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_SINKS = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.sinks")
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down)_exps\.weight")


def _sliding_layers(meta: dict, layers: int, path: str) -> list[bool]:
    """Which layers slide, as ``llama_model_base::load_swa_pattern(ml, 2)`` decides (``dense_first`` false)."""
    key = f"{ARCH}.attention.sliding_window_pattern"
    pattern = meta.get(key, 2)
    if not np.isscalar(pattern):
        flags = [bool(x) for x in pattern]
        if len(flags) != layers:
            raise ValueError(f"{ARCH} GGUF file {path}: {key} has {len(flags)} entries for {layers} blocks")
        return flags
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _rope_parameters(meta: dict, path: str) -> dict[str, Any]:
    """HF's ``rope_parameters`` from the file's rope keys (module docstring)."""
    theta = float(meta.get(f"{ARCH}.rope.freq_base", 10000.0))
    swa = meta.get(f"{ARCH}.rope.freq_base_swa")
    if swa is not None and float(swa) != theta:
        raise ValueError(f"{ARCH} GGUF file {path}: {ARCH}.rope.freq_base_swa {swa} differs from rope.freq_base "
                         f"{theta} (one rotary base for every layer is mapped)")
    kind = meta.get(f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}

    def k(key: str) -> Any:
        name = f"{ARCH}.rope.scaling.{key}"
        if name not in meta:
            raise ValueError(f"GGUF file {path} lacks metadata key {name!r}")
        return meta[name]

    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(k("factor"))}
    if kind != "yarn":
        raise ValueError(f"{ARCH} GGUF file {path}: rope scaling {kind!r} is not mapped (yarn or linear)")
    for key in ("yarn_attn_factor", "yarn_ext_factor"):
        value = meta.get(f"{ARCH}.rope.scaling.{key}")
        if value is not None and float(value) != 1.0:
            raise ValueError(f"{ARCH} GGUF file {path}: {ARCH}.rope.scaling.{key} {value} is not mapped (only 1)")
    if float(meta.get(f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.0)):
        raise ValueError(f"{ARCH} GGUF file {path}: {ARCH}.rope.scaling.yarn_log_multiplier is not mapped")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(k("factor")),
            "original_max_position_embeddings": int(k("original_context_length")),
            "beta_fast": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}


def gpt_oss_config(path: str, meta: dict, shapes: dict[str, tuple[int, ...]]) -> Any:
    """``GptOssConfig`` of the ``gpt-oss`` GGUF at ``path`` (``meta``: its scalar metadata, ``shapes``: its tensor
    shapes innermost first)."""
    from transformers import GptOssConfig  # heavy: transformers

    def k(key: str) -> Any:
        if f"{ARCH}.{key}" not in meta:
            raise ValueError(f"GGUF file {path} lacks metadata key {f'{ARCH}.{key}'!r}")
        return meta[f"{ARCH}.{key}"]

    hidden, layers, heads = int(k("embedding_length")), int(k("block_count")), int(k("attention.head_count"))
    head_dim = int(meta.get(f"{ARCH}.attention.key_length", hidden // heads))
    value_dim = int(meta.get(f"{ARCH}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"{ARCH} GGUF file {path}: {ARCH}.attention.value_length {value_dim} differs from "
                         f"attention.key_length {head_dim}")
    rot = int(meta.get(f"{ARCH}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"{ARCH} GGUF file {path}: {ARCH}.rope.dimension_count {rot}: partial rotary is not run "
                         f"(head size {head_dim})")
    window = int(k("attention.sliding_window"))
    experts, ffn = int(k("expert_count")), int(k("expert_feed_forward_length"))
    sliding = _sliding_layers(meta, layers, path)
    return GptOssConfig(
        vocab_size=int(shapes["token_embd.weight"][1]), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=int(meta.get(f"{ARCH}.attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate_size=ffn, num_local_experts=experts,
        num_experts_per_tok=int(k("expert_used_count")), sliding_window=window,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(k("context_length")),
        rope_parameters=_rope_parameters(meta, path), attention_bias="blk.0.attn_q.bias" in shapes,
        swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT, tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), architectures=["GptOssForCausalLM"])


class GptOssLayout:
    """The converter's renames, splits and transposes for one file (``types``: each tensor's GGML type name)."""

    def __init__(self, types: dict[str, str]):
        experts = Counter(t for name, t in types.items() if _EXPERT_TENSOR.fullmatch(name))
        if set(experts) - {"F32"}:
            logger.info("gpt-oss GGUF: expert tensors %s dequantized at load by gguf.quants (the experts run in "
                        "torch, no kernel takes them: they cost their dense size)",
                        ", ".join(f"{n} x {t}" for t, n in experts.most_common()))

    @staticmethod
    def parts(hf_name: str) -> Optional[list[str]]:
        """The (gate, up) GGUF tensors ``gate_up_proj`` (or its bias) was split into; None for every other tensor."""
        m = _EXPERTS.fullmatch(hf_name)
        if m is None or m[2] != "gate_up_proj":
            return None
        kind = "bias" if m[3] else "weight"
        return [f"blk.{m[1]}.ffn_{p}_exps.{kind}" for p in ("gate", "up")]

    @staticmethod
    def gguf_name(hf_name: str) -> Optional[str]:
        """The file's name for a tensor the name map would miss (sinks renamed, ``down_proj`` and its bias)."""
        m = _SINKS.fullmatch(hf_name)
        if m is not None:
            return f"blk.{m[1]}.attn_sinks.weight"
        m = _EXPERTS.fullmatch(hf_name)
        if m is not None and m[2] == "down_proj":
            return f"blk.{m[1]}.ffn_down_exps.{'bias' if m[3] else 'weight'}"
        return None

    @staticmethod
    def join(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """HF's interleaved ``gate_up_proj`` ``[E, H, 2I]`` from ``[E, I, H]`` parts (biases: ``[E, 2I]`` from
        ``[E, I]``)."""
        if gate.ndim == 3:
            gate, up = gate.swapaxes(1, 2), up.swapaxes(1, 2)
        out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=np.float32)
        out[..., ::2], out[..., 1::2] = gate, up
        return out

    @staticmethod
    def undo(gguf_name: str, data: np.ndarray) -> Optional[np.ndarray]:
        """``down_proj`` transposed back to ``[E, I, H]`` (None: the tensor as the file holds it)."""
        if gguf_name.endswith("ffn_down_exps.weight"):
            return np.ascontiguousarray(data.swapaxes(1, 2))
        return None
