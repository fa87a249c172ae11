"""``load_model``: HF config + checkpoint (folder or GGUF) -> a native ``CausalLM`` on the backend's device."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Any, Optional

import torch

from pagedllm.distributed.dp_ep import get_dp_ep_state, shard_expert_weights, shard_experts
from pagedllm.distributed.parallel_state import get_parallel_state
from pagedllm.distributed.sharding import local_config, parallelize, shard_state_dict
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import ARCHITECTURES, architecture_of, resolve_model_impl
from pagedllm.models.bert import ENCODER_ARCHITECTURES, build_encoder_model
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.dense_linears import block_head, pack_dense_linears
from pagedllm.models.falcon import FalconCausalLM
from pagedllm.models.granite_hybrid import GraniteMoeHybridCausalLM
from pagedllm.models.lfm2 import Lfm2CausalLM
from pagedllm.models.gemma3_mm import build_gemma3_mm_model
from pagedllm.models.idefics3 import build_idefics3_model
from pagedllm.models.llava import build_llava_model
from pagedllm.models.qwen2_vl import build_qwen2_vl_model
from pagedllm.models.qwen3_next import Qwen3NextCausalLM
from pagedllm.models.mamba2 import Mamba2CausalLM
from pagedllm.models.stablelm import StableLmCausalLM
from pagedllm.models.gguf_moe import complete_moe_config
from pagedllm.models.gpt_oss import Mxfp4Weights, is_mxfp4_checkpoint
from pagedllm.models.gguf_weights import GGUFWeights
from pagedllm.models.heap import trim_heap
from pagedllm.models.paths import is_gguf, resolve_model_path
from pagedllm.models.quantized_checkpoint import QuantizedCheckpoint
from pagedllm.models.quantized_embedding import quantize_embedding
from pagedllm.models.quantized_linears import quantize_linears
from pagedllm.models.remote_layouts import check_covered, remote_code_config, wrap_weights
from pagedllm.models.rope import build_cos_sin_cache, per_layer_type
from pagedllm.models.sequence_classification import finish_heads, prepare_heads
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.models.transformers_impl import load_transformers_model
from pagedllm.backend.kv_quant import load_kv_scales
from pagedllm.models.weights import SafetensorsWeights, checkpoint_prefix, fused_state_dict
from pagedllm.quantization.config import checkpoint_quant_config, checkpoint_quantization
from pagedllm.quantization.fp8 import FP8Weights, is_fp8_checkpoint
from pagedllm.quantization.linear import QuantizedLinear
from pagedllm.models.gguf_archs import (OWN_CONFIG_ARCHS, complete_falcon_config, complete_gemma_config,
                                        complete_phi3_config, complete_stablelm_config, gguf_architecture,
                                        own_gguf_config)
from pagedllm.models.gguf_config import load_gguf_config
from pagedllm.startup_log import progress_bar, stage

logger = logging.getLogger(__name__)


def load_config(model_path: str) -> Any:
    """The HF config, never running remote code; for GGUF, the one transformers derives from the metadata."""
    stage("resolving model %s: reading its %s", model_path, "GGUF metadata" if is_gguf(model_path) else "config")
    from transformers import AutoConfig  # heavy: transformers

    if is_gguf(model_path):
        arch = gguf_architecture(model_path)
        if arch in OWN_CONFIG_ARCHS:  # transformers' GGUF config mapping has no entry for these
            return own_gguf_config(model_path, arch)
        config = load_gguf_config(model_path)
        complete = {"falcon": complete_falcon_config, "phi3": complete_phi3_config,  # what transformers' GGUF
                    "gemma2": complete_gemma_config, "gemma3_text": complete_gemma_config,  # config cannot say
                    "stablelm": complete_stablelm_config}
        return complete.get(config.model_type, complete_moe_config)(model_path, config)
    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    except (ValueError, KeyError) as e:  # a model_type transformers does not know: remote code only (ChatGLM...)
        raw = os.path.join(model_path, "config.json")
        if not os.path.isfile(raw):
            raise
        with open(raw) as f:
            cfg = json.load(f)
        mapped = remote_code_config(cfg)  # a remote-code layout we load by name mapping (Baichuan)
        if mapped is not None:
            return mapped
        archs = ", ".join(cfg.get("architectures") or []) or "?"
        remote = " (remote code, which pagedllm never runs)" if "auto_map" in cfg else ""
        raise UnsupportedModelError(
            f"unsupported model architecture {archs} (model_type {cfg.get('model_type')!r}){remote}: transformers "
            f"does not know it; pagedllm supports {', '.join(ARCHITECTURES)} natively, and through the transformers "
            "fallback any decoder-only *ForCausalLM transformers implements (docs/models.md)") from e


def eos_token_ids(model_path: str, config: Any) -> list[int]:
    """Stop ids: ``generation_config.json`` when the folder has one (chat models list several), else the config's."""
    eos = getattr(config, "eos_token_id", None)
    if not is_gguf(model_path) and os.path.isfile(os.path.join(model_path, "generation_config.json")):
        from transformers import GenerationConfig  # heavy: transformers

        gen = GenerationConfig.from_pretrained(model_path)
        if gen.eos_token_id is not None:
            eos = gen.eos_token_id
    ids = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return list(dict.fromkeys(int(i) for i in ids))


def load_model(model_path: str, *, backend: Any, dtype: torch.dtype, device: torch.device,
               config: Any = None, model_impl: str = "auto", max_model_len: int | None = None,
               quantization: Optional[str] = None) -> Any:
    """Build the model for ``model_path`` (HF ``config`` if already read) with weights in ``dtype`` on ``device``:
    our native ``CausalLM``, or transformers' module with our paged attention (``model_impl``, vLLM's
    ``--model-impl``). ``max_model_len`` (default: the config's) picks LongRoPE's factors. ``quantization`` (a
    method name, resolved by ``pagedllm.quantization.resolve_quantization``) keeps packed linear weights packed on
    the native path and runs them through the backend's kernel; ``None`` dequantizes everything to ``dtype``.
    Unsupported architectures fail (UnsupportedModelError) before any weight is read.
    """
    path = resolve_model_path(model_path)
    device = torch.device(device)
    config = config if config is not None else load_config(path)
    name, impl = resolve_model_impl(config, model_impl)
    shown = f"{config.pagedllm_source_architecture} (as {name})" if hasattr(config, "pagedllm_layout") else name
    logger.info("model %s: %s implementation%s", shown, impl,
                " (transformers' module, pagedllm paged attention)" if impl == "transformers" else "")
    t0 = time.perf_counter()
    stage("reading weights: %s (%s, %s)", path, shown, "transformers module" if impl != "native"
          else "native encoder" if name in ENCODER_ARCHITECTURES else "native decoder")
    if impl == "transformers":
        if get_parallel_state() is not None:
            raise UnsupportedModelError(f"{shown}: tensor/pipeline parallel runs native models only, not the "
                                        "transformers fallback")
        if hasattr(config, "pagedllm_layout"):
            raise UnsupportedModelError(f"{shown} is a remote-code layout mapped onto the native decoder; the "
                                        "transformers fallback cannot load it (use --model-impl auto or native)")
        if quantization is not None:
            raise UnsupportedModelError(f"quantization={quantization!r} runs on the native decoder only; {shown} "
                                        f"uses the transformers fallback (pass quantization='none' to dequantize "
                                        f"to {dtype} at load)")
        model = load_transformers_model(path, config, backend=backend, dtype=dtype, device=device)
        model.eos_token_ids = eos_token_ids(path, config)
        stage("weights read in %.1fs: %s", time.perf_counter() - t0, weights_summary(model, path, dtype))
        return model
    arch_name, spec = architecture_of(config)
    if spec.module == "bert":  # encoder-only: its own small loader (models/bert.py)
        if get_parallel_state() is not None or quantization is not None or is_gguf(path):
            raise UnsupportedModelError(f"{shown}: encoder models load unquantized safetensors on one rank only")
        model = build_encoder_model(path, config, arch_name, backend, dtype, device)
        stage("weights read in %.1fs: %s", time.perf_counter() - t0, weights_summary(model, path, dtype))
        return model
    if spec.module in ("llava", "idefics3", "qwen2_vl", "gemma3_mm"):  # vision tower + native decoder (llava.py,
        # idefics3.py, qwen2_vl.py, gemma3_mm.py)
        if get_parallel_state() is not None or quantization is not None or is_gguf(path):
            raise UnsupportedModelError(f"{shown}: vision-language models load unquantized safetensors on one "
                                        "rank only")
        build = {"llava": build_llava_model, "idefics3": build_idefics3_model,
                 "qwen2_vl": build_qwen2_vl_model, "gemma3_mm": build_gemma3_mm_model}[spec.module]
        model = build(path, config, backend, dtype, device)
        stage("weights read in %.1fs: %s", time.perf_counter() - t0, weights_summary(model, path, dtype))
        return model
    full_config, par = config, get_parallel_state()
    if par is not None:  # one rank of a distributed engine: this rank's heads, columns and layers
        if quantization is not None:
            raise UnsupportedModelError("tensor/pipeline parallel runs unquantized native models only")
        if spec.sinks:  # the per-head sinks and GPT-OSS's stacked expert tensors are not sharded
            raise UnsupportedModelError(f"{shown}: tensor/pipeline parallel does not shard attention sinks or "
                                        "GPT-OSS's experts yet")
        config = local_config(config, par)
    with torch.device("meta"):
        module = {"falcon": FalconCausalLM, "stablelm": StableLmCausalLM, "lfm2": Lfm2CausalLM,
                  "qwen3_next": Qwen3NextCausalLM,
                  "mamba2": Mamba2CausalLM, "granite_hybrid": GraniteMoeHybridCausalLM}.get(spec.module, CausalLM)
        model = module(config, spec, backend)
        if par is not None:
            if spec.module != "decoder":
                raise UnsupportedModelError(f"{shown}: tensor/pipeline parallel does not shard {spec.module} layouts "
                                            "yet")
            parallelize(model, full_config, par)
        dp_ep = get_dp_ep_state()
        if dp_ep is not None:  # a DP+EP replica: this replica's experts only (distributed/dp_ep.py)
            shard_experts(model, dp_ep)
    fp8_checkpoint = is_fp8_checkpoint(config)
    mxfp4 = is_mxfp4_checkpoint(config)  # GPT-OSS MXFP4 experts: dequantized at load
    qc = None if is_gguf(path) or mxfp4 else checkpoint_quant_config(config)
    if is_gguf(path):
        weights = GGUFWeights(path, config)
    elif mxfp4:
        weights = Mxfp4Weights(SafetensorsWeights(path))
    elif qc is not None and not fp8_checkpoint:  # GPTQ / AWQ / compressed-tensors: packed tensors
        checkpoint_quantization(config)
        weights = QuantizedCheckpoint(SafetensorsWeights(path), qc)
    else:
        weights = wrap_weights(SafetensorsWeights(path), config)
    if spec.module == "decoder":  # pooling heads: score, or no LM head (models/sequence_classification.py)
        prepare_heads(model, config, arch_name, weights)
    if quantization == "fp8" or fp8_checkpoint:  # e4m3 weights + scales, or online quantization (quantization/fp8.py)
        weights = FP8Weights(weights, online=not fp8_checkpoint)
    bar = progress_bar(len(model.state_dict()), "reading weights", unit="tensor")
    if quantization is not None:
        quantize_embedding(model, weights, dtype, device)
        model.lm_head_kernel = block_head(model, backend, dtype, device)  # first, while little else is resident
        quantize_linears(model, weights, backend, dtype, device, progress=bar.update)
        trim_heap()
    sd = fused_state_dict(model, weights, dtype, device, progress=bar.update)
    bar.close()
    if par is not None:
        sd = shard_state_dict(sd, full_config, par)
    if dp_ep is not None:
        sd = shard_expert_weights(sd, dp_ep)
    model.load_state_dict(sd, strict=True, assign=True)
    del sd
    attentions = [getattr(layer, "self_attn", None) for layer in getattr(model, "layers", [])]
    if load_kv_scales(attentions, weights, checkpoint_prefix(weights)):
        logger.info("fp8 KV cache scales (k_scale/v_scale) read from the checkpoint")
    if hasattr(weights, "taken"):  # a remote-code layout: every checkpoint tensor must have been mapped
        check_covered(weights, weights.source.names())
    del weights
    packed = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # fp8 weights count as exact: no backend here has an FP8 GEMM, they are dequantized at load (fp32 activations)
    on_kernels = bool(packed) and not any(m.kernel_name.startswith("reference") or m.method == "fp8" for m in packed)
    trim_heap()
    pack_dense_linears(model, backend, dtype, device, quantized=on_kernels)
    trim_heap()
    model.cos_sin_cache = build_cos_sin_cache(config, model.max_model_len, device, max_model_len)
    if per_layer_type(config):  # Gemma 3: each layer type has its own rotary base
        model.rope_caches = {t: build_cos_sin_cache(config, model.max_model_len, device, max_model_len, t)
                             for t in sorted(set(config.layer_types))}
    model.eos_token_ids = eos_token_ids(path, config)
    if getattr(config, "classifier_from_token", None):
        finish_heads(model, config, load_tokenizer(path, config))
    stage("weights read in %.1fs: %s", time.perf_counter() - t0, weights_summary(model, path, dtype))
    return model.requires_grad_(False).eval()


def weights_summary(model: Any, path: str, dtype: torch.dtype) -> str:
    """How the weights are held, for the start-up line (``serve`` shows the quantization in use): "GGUF Q4_1 packed
    (210 linears, kernel ...); float32 activations", or the dense dtype."""
    kinds = Counter((m.method, m.weight_type, m.kernel_name) for m in model.modules()
                    if isinstance(m, QuantizedLinear))
    act = str(dtype).removeprefix("torch.")
    if not kinds:
        return f"GGUF dequantized to {act}" if is_gguf(path) else f"{act}, not quantized"
    parts = []
    for (method, weight_type, kernel), n in kinds.most_common():
        how = "dequantized at load" if kernel.startswith("reference") else "packed"
        parts.append(f"{method.upper()} {weight_type} {how} ({n} linear{'s' * (n != 1)}, kernel {kernel})")
    return f"{', '.join(parts)}; {act} activations"
