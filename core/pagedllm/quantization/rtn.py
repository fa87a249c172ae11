"""Write GPTQ, AWQ and compressed-tensors W8A8 checkpoints from a dense HF folder by round-to-nearest.

No quantized model wheels exist offline and GPTQ/AWQ's own quantizers need calibration stacks that do not install
here, so tests and ``pagedllm bench`` make their checkpoints with this: the exact on-disk formats, RTN values
(the formats do not record how values were chosen). Returns the dense weights the written files stand for,
computed before packing: the hand-dequantized oracle the loader is compared with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization.awq import write_awq
from pagedllm.quantization.gptq import write_gptq
from pagedllm.quantization.grouped import contiguous_g_idx, pack_cols, round_to_nearest
from pagedllm.quantization.int8 import quantize_weight_per_channel

#: HF names of the decoder linears these formats quantize (lm_head and embeddings stay dense, as llm-compressor's
#: and AutoGPTQ's defaults do).
LINEAR = re.compile(r"(.*\.)(q|k|v|o|gate|up|down)_proj\.weight$")
_SHARED_INPUT = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gateup", "up": "gateup"}


def _desc_act_g_idx(k: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A permuted g_idx like GPTQ's act-order writes: groups of ``group_size`` columns in a random column order."""
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = contiguous_g_idx(k, group_size)
    return g_idx


def quantize_folder(src: str, dst: str, method: str, *, bits: int = 4, group_size: int = 128, sym: bool = True,
                    desc_act: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Copy the HF folder ``src`` to ``dst`` with its decoder linears in ``method``'s format (``gptq``, ``awq``,
    or ``w8a8``: compressed-tensors int-quantized, per-channel int8 weights + dynamic per-token int8 activations)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".index.json") and \
                os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"{src}: expected one model.safetensors, found {files}")
    tensors = load_file(os.path.join(src, files[0]))
    gen, perms, dense, out = torch.Generator().manual_seed(seed), {}, {}, {}
    for name, w in tensors.items():
        m = LINEAR.match(name)
        if m is None:
            out[name] = w
            continue
        module = name.removesuffix(".weight")
        if method == "w8a8":
            q, scale = quantize_weight_per_channel(w)
            out[f"{module}.weight"], out[f"{module}.weight_scale"] = q, scale.to(w.dtype)
            dense[name] = q.float() * scale
            continue
        g_idx = None
        if desc_act:
            key = m.group(1) + _SHARED_INPUT.get(m.group(2), m.group(2))
            if key not in perms:
                perms[key] = _desc_act_g_idx(w.shape[1], group_size, gen)
            g_idx = perms[key]
        g = round_to_nearest(w, bits, group_size, sym, g_idx)
        dense[name] = g.dense()
        packed = write_gptq(g) if method == "gptq" else write_awq(g)
        out.update({f"{module}.{t}": v for t, v in packed.items()})
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config(method, bits, group_size, sym, desc_act)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dense


def quant_config(method: str, bits: int, group_size: int, sym: bool, desc_act: bool) -> dict[str, Any]:
    """The ``quantization_config`` each format's writer puts in config.json (the fields readers look at)."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not sym,
                "version": "gemm"}
    if method == "w8a8":
        return {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "format": "int-quantized",
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False, "observer": "minmax"},
                    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "dynamic": True, "observer": None}}}}
    raise ValueError(f"unknown method {method!r} (gptq, awq, w8a8)")


def random_weight(method: str, weight_type: str, n: int, k: int, gen: torch.Generator) -> Any:
    """A random ``[n, k]`` weight (std 0.02) packed as ``method`` / ``weight_type`` (conformance and bench): GPTQ
    int4 with act-order groups of 128 (a permuted g_idx), int8 per channel; AWQ groups of 64, asymmetric;
    compressed-tensors W4A16 groups of 32, W8A16 / W8A8 int8 per channel."""
    w = torch.randn(n, k, generator=gen) * 0.02
    if method == "gptq":
        bits = int(weight_type.removeprefix("int"))
        g_idx = _desc_act_g_idx(k, 128, gen) if bits == 4 else None
        g = round_to_nearest(w, bits, 128 if bits == 4 else -1, sym=False, g_idx=g_idx)
        return QuantizedWeight(method, weight_type, write_gptq(g), (n, k))
    if method == "awq":
        g = round_to_nearest(w, 4, 64, sym=False)
        return QuantizedWeight(method, weight_type, {**write_awq(g), "g_idx": g.g_idx.int()}, (n, k))
    if method == "compressed-tensors" and weight_type == "W4A16":
        g = round_to_nearest(w, 4, 32, sym=True)
        return QuantizedWeight(method, weight_type, {"weight_packed": pack_cols(g.q, 4),
                                                     "weight_scale": g.scales.t().contiguous(),
                                                     "zero": g.zeros.t().int().contiguous()}, (n, k))
    if method == "compressed-tensors" and weight_type in ("W8A16", "W8A8"):
        q, s = quantize_weight_per_channel(w)
        return QuantizedWeight(method, weight_type, {"weight": q, "weight_scale": s, "zero": torch.zeros_like(s).int()},
                               (n, k))
    raise ValueError(f"no random {method} {weight_type} weight")
