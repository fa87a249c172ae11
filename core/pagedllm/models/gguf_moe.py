"""What transformers' GGUF config leaves out for MoE files, recovered from the file itself.

- qwen2moe: its key map has no ``expert_feed_forward_length`` / ``expert_shared_feed_forward_length``, so the expert
  sizes stay at Qwen2-MoE-A2.7B's defaults; the tensor shapes give the real ones.
- qwen3moe: the same gap for ``expert_feed_forward_length``; and llama.cpp's graph always renormalises the top-k
  weights (Qwen3-MoE checkpoints say ``norm_topk_prob: true``), where transformers' config defaults to false.
- Mixtral: llama.cpp writes it as arch "llama" with stacked expert tensors (``ffn_*_exps``), and transformers'
  llama key map has no expert keys, so it derives a dense ``LlamaConfig`` that cannot hold the file. The expert
  tensors mark such a file; the expert count comes from their shape and top-k from ``llama.expert_used_count``.
  llama.cpp's llama graph renormalises the top-k weights and has no sliding window, as the Mixtral config says.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pagedllm.models.gguf_weights import read_tensors


def _expert_shapes(path: str) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in read_tensors(path)[1]
            if t.name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_shexp.weight")}


def _metadata_int(path: str, key: str) -> int:
    st = os.stat(path)
    return _metadata_int_cached(os.path.realpath(path), key, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _metadata_int_cached(path: str, key: str, size: int, mtime_ns: int) -> int:
    """Once per file and process: ``GGUFReader`` parses every metadata array (seconds for a 32k vocabulary), and
    the config is read by the engine, the executor and each worker."""
    import gguf  # heavy: gguf

    field = gguf.GGUFReader(path).fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file {path} has expert tensors but no {key!r}")
    return int(field.parts[field.data[0]][0])


def complete_moe_config(path: str, config: Any) -> Any:
    """``config`` (transformers' derivation for the GGUF at ``path``) with the MoE fields it lacks."""
    if config.model_type not in ("qwen2_moe", "qwen3_moe", "llama", "mistral"):
        return config
    shapes = _expert_shapes(path)
    experts = shapes.get("blk.0.ffn_gate_exps.weight")  # innermost first: (hidden, intermediate, experts)
    if config.model_type == "qwen3_moe":
        if experts is not None:
            config.moe_intermediate_size = int(experts[1])
        config.norm_topk_prob = True
        return config
    if config.model_type == "qwen2_moe":
        if experts is not None:
            config.moe_intermediate_size = int(experts[1])
        if "blk.0.ffn_gate_shexp.weight" in shapes:
            config.shared_expert_intermediate_size = int(shapes["blk.0.ffn_gate_shexp.weight"][1])
        return config
    if experts is None:
        return config
    from transformers import MixtralConfig  # heavy: transformers

    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("architectures", "model_type", "transformers_version", "intermediate_size")}
    return MixtralConfig(**fields, architectures=["MixtralForCausalLM"], intermediate_size=int(experts[1]),
                         num_local_experts=int(experts[2]), sliding_window=None,
                         num_experts_per_tok=_metadata_int(path, "llama.expert_used_count"))
