"""HF configs for GGUF architectures transformers' GGUF config mapping does not know, built from the file's metadata.

transformers refuses these archs ("GGUF model with architecture ... is not supported yet"); gguf-py knows their
tensor names, so only the config is ours. Keys are those llama.cpp's ``convert_hf_to_gguf.py`` writes:

- ``glm4`` (GLM-4-0414, transformers' ``Glm4``): ``rope.dimension_count`` is the rotary part of the head
  (``head_dim * partial_rotary_factor``), rotary pairs interleaved (GGML's "norm" rope: no q/k permute), qkv bias
  when the file has ``attn_q.bias``, the fused ``gate_up_proj`` kept as ``ffn_up``, the post-attention/post-MLP norms
  as ``post_attention_norm`` / ``post_ffw_norm``.
- ``baichuan``: Llama with ``W_pack`` split into q/k/v (q/k rows permuted like Llama's); llama.cpp runs a 40-layer
  file as Baichuan-13B (ALiBi, no rotary) and any other depth as 7B (rotary), and so does this.
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: GGUF architectures whose config is built here (the rest go through transformers).
OWN_CONFIG_ARCHS = ("glm4", "baichuan")


def gguf_architecture(path: str) -> str:
    from pagedllm.models.gguf_weights import read_tensors

    return read_tensors(path)[0]


@functools.lru_cache(maxsize=8)
def _metadata(path: str, size: int, mtime_ns: int) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(scalar metadata, tensor shapes innermost first) of a file, once per file and process; string arrays (the
    vocabulary) are skipped by transformers' header reader."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    from pagedllm.models.gguf_weights import read_tensors

    meta, _ = read_gguf_metadata(path)
    return meta, {t.name: t.shape for t in read_tensors(path)[1]}


def _require(meta: dict, key: str, path: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF file {path} lacks metadata key {key!r}")
    return meta[key]


def _common(path: str, arch: str) -> tuple[dict, dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata, the Llama-like config fields every arch here shares, tensor shapes)."""
    st = os.stat(path)
    meta, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    k = lambda key: _require(meta, f"{arch}.{key}", path)  # noqa: E731
    heads = int(k("attention.head_count"))
    fields = dict(
        vocab_size=int(shapes["token_embd.weight"][1]), hidden_size=int(k("embedding_length")),
        intermediate_size=int(k("feed_forward_length")), num_hidden_layers=int(k("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(k("context_length")), rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    return meta, fields, shapes


def glm4_config(path: str) -> Any:
    from transformers import Glm4Config

    meta, fields, shapes = _common(path, "glm4")
    head_dim = int(meta.get("glm4.attention.key_length", fields["hidden_size"] // fields["num_attention_heads"]))
    rotary = int(meta.get("glm4.rope.dimension_count", head_dim // 2))
    return Glm4Config(**fields, head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
                      attention_bias="blk.0.attn_q.bias" in shapes, architectures=["Glm4ForCausalLM"])


def baichuan_config(path: str) -> Any:
    from transformers import LlamaConfig

    _, fields, _ = _common(path, "baichuan")
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    config.pagedllm_alibi = fields["num_hidden_layers"] == 40  # llama.cpp's LLM_TYPE_13B: ALiBi, no rotary
    config.pagedllm_source_architecture = "BaichuanForCausalLM"
    return config


def own_gguf_config(path: str, arch: str) -> Any:
    """The HF config of a GGUF file of an ``OWN_CONFIG_ARCHS`` architecture."""
    return {"glm4": glm4_config, "baichuan": baichuan_config}[arch](path)
