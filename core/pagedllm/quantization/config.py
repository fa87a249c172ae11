"""Which quantization an engine runs: the user's ``quantization=`` against the checkpoint and the backend."""

from __future__ import annotations

import logging
from typing import Any, Optional

from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.quantization.base import get_method

logger = logging.getLogger(__name__)

#: vLLM's method names (``--quantization``); ``none`` means dense weights in the engine dtype.
QUANTIZATION_METHODS = ("gguf", "gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors", "fp8",
                        "fbgemm_fp8", "bitsandbytes", "experts_int8", "modelopt", "torchao", "quark", "mxfp4")
#: The methods core implements today (a backend declares the ones it runs in ``Capabilities.quantization``).
IMPLEMENTED = ("gguf", "gptq", "awq", "compressed-tensors", "fp8")
#: Methods read from a safetensors checkpoint's ``config.json`` ``quantization_config``.
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")


def checkpoint_quant_config(config: Any) -> Optional[dict]:
    """The HF config's ``quantization_config`` as a dict (None: not quantized)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def checkpoint_quantization(config: Any) -> Optional[str]:
    """The method of a quantized safetensors checkpoint, its config checked (an unsupported variant fails here,
    before any weight is read, naming what is unsupported)."""
    qc = checkpoint_quant_config(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in CHECKPOINT_METHODS:
        raise UnsupportedModelError(f"checkpoint quantization_config.quant_method={method!r} is not supported "
                                    f"(supported: {', '.join(CHECKPOINT_METHODS)}, and GGUF files)")
    get_method(method).check_config(qc)
    return method
#: Methods that also quantize a dense (or GGUF, dequantized first) checkpoint at load when asked for explicitly.
ONLINE = ("fp8",)


def validate_quantization(value: Optional[str]) -> None:
    if value is None or value == "none":
        return
    if value not in QUANTIZATION_METHODS:
        raise ParamError("quantization", f"unknown method {value!r}; known: none, {', '.join(QUANTIZATION_METHODS)}")
    if value not in IMPLEMENTED:
        raise ParamError("quantization", f"{value!r} is not implemented by pagedllm yet; implemented: "
                                         f"{', '.join(IMPLEMENTED)} (or none)")


def resolve_quantization(requested: Optional[str], user_dtype: str, checkpoint: Optional[str], backend: Any,
                         dtype: str) -> Optional[str]:
    """The method the engine runs (``None``: dense weights in ``dtype``).

    Unset: a quantized checkpoint runs quantized when the backend declares its method and the user gave no dtype;
    with an explicit dtype (or a backend without the method) it is dequantized to that dtype at load, and the log
    says so. An explicit method the backend does not declare, or that the checkpoint is not in, is an error; except
    ``fp8`` on a dense (or GGUF) checkpoint, which quantizes its (dequantized) weights at load (vLLM's online fp8).
    """
    caps = backend.capabilities.quantization
    if requested == "none":
        return None
    if requested is None:
        if checkpoint is None:
            return None
        if checkpoint in caps and user_dtype == "auto":
            return checkpoint
        why = (f"dtype={user_dtype} was given" if checkpoint in caps
               else f"backend {backend.name!r} does not run {checkpoint} (runs: {', '.join(caps) or 'none'})")
        logger.info("%s checkpoint dequantized to %s at load: %s; pass quantization=%s to keep it packed",
                    checkpoint, dtype, why, checkpoint)
        return None
    if checkpoint != requested and not (checkpoint in (None, "gguf") and requested in ONLINE):
        raise ParamError("quantization", f"{requested!r} was requested, but the checkpoint is "
                                         f"{checkpoint or 'not quantized'}")
    if requested not in caps:
        raise ParamError("quantization", f"backend {backend.name!r} does not support {requested!r} "
                                         f"(supports: {', '.join(caps) or 'none'}); pass quantization='none' to "
                                         f"dequantize to {dtype} at load")
    return requested
