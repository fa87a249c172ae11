"""Graph-capture strategy on CPU: eager, because torch.compile measured slower here and compiles for seconds.

``pagedllm bench graph``: core's model as a tiny Llama (hidden 256, 4 layers, 8/4 heads, head_dim 32, fp32) decoding 64
sequences at context 64-96, torch 2.13. Two threads, quiet machine, best of 5 rounds: eager 8.3 ms/step;
torch.compile(dynamic=True) of the whole forward (attention left opaque) 9.1 ms after a 14.8 s cold compile.
One thread, CPU time: eager 12.3-13.8 ms; whole forward 13.9 ms (17.6 s compile); per decoder layer 14.2 ms (15.2 s);
norms+MLP only 13.2-15.5 ms (11.6 s). The step is bound by matmuls and the KV gather, which inductor does not
improve, and any compile breaks the 5 s cold-start target; a CPU has no launch overhead for graphs to amortize.
What a CPU has instead is the interpreter between ops: a GGUF Llama-family model's pure-decode steps run their decoder
layers in one C++ call (``decode_layers.py``; the same ops, the same bits), every other model and step eager.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backend.hookspec import GraphRunner
from pagedllm_cpu import decode_layers

#: What ``Capabilities.graph_capture`` reports: nothing is captured.
CAPTURE_LEVEL = "none"


def make_runner(model: Any, max_num_seqs: int, device: torch.device) -> GraphRunner:
    """``run`` is the model itself, or ``decode_layers.DecodeRunner`` where its layers take that path."""
    reason = decode_layers.ineligible(model)
    if reason is not None:
        return GraphRunner(run=model, level="none", stats={"strategy": "eager"})
    stats = {"strategy": "eager", "decode_layers_steps": 0}
    return GraphRunner(run=decode_layers.DecodeRunner(model, stats), level="none", stats=stats)
