"""Core never names a vendor device, SDK or collective library: vendor code lives only in its plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pagedllm

VENDOR = re.compile(r"\b(ascend|gaudi|habana|hpu|npu|tpu|xla|xpu|ipex|hccl|xccl|torch_npu|cann|synapse)\b", re.I)


def test_no_core_source_file_names_a_vendor():
    root = Path(pagedllm.__file__).parent
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if VENDOR.search(line)]
    assert not hits, "\n".join(hits)
