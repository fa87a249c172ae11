"""Core never names a vendor device, SDK, driver or collective library: vendor code lives only in its plugin; the GPU
code core shares (``backend/accelerator.py``, ``backend/triton/``) takes the device type and names from the plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pagedllm

NAMES = ("ascend", "gaudi", "habana", "hpu", "npu", "tpu", "xla", "xpu", "ipex", "hccl", "xccl", "torch_npu", "cann",
         "synapse", "cuda", "cudagraph", "libcuda", "rocm", "hip", "nvidia", "amd", "nccl", "rccl")
# A name counts when no letter comes before it and no lowercase letter after it: ``torch.cuda``, ``is_cuda``,
# ``CUDAGraph``, ``HIP`` are found; ``ship``, ``barracuda``, ``input``, ``output``, ``cannot`` are not.
VENDOR = re.compile(r"(?<![A-Za-z])(?i:" + "|".join(NAMES) + r")(?![a-z])")
# The one exception: contract v2's old module path, kept importable for one contract version (pagedllm.deprecated).
ALLOWED = {"deprecated.py": "pagedllm.kernels.torch_cuda"}


def _names_a_vendor(path: str, line: str) -> bool:
    allowed = ALLOWED.get(path)
    return bool(VENDOR.search(line.replace(allowed, "") if allowed else line))


def test_no_core_source_file_names_a_vendor():
    root = Path(pagedllm.__file__).parent
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if _names_a_vendor(str(p.relative_to(root)), line)]
    assert not hits, "\n".join(hits)


def test_the_guard_finds_vendor_names_and_not_ordinary_words():
    for text in ("torch.cuda.synchronize()", "x.is_cuda", "torch.cuda.CUDAGraph", "HIP graphs", "libcuda.so.1",
                 "nccl", "RCCL", "ROCm", "NVIDIA", "AMD GPUs", "torch.xpu", "torch_npu", "XPUGraph"):
        assert VENDOR.search(text), text
    for text in ("relationship", "chip", "barracuda", "input_ids", "output", "cannot", "accelerator", "graph_class"):
        assert not VENDOR.search(text), text
