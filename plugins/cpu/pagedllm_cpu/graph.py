"""Graph-capture strategy on CPU: eager, because torch.compile measured slower here and compiles for seconds.

``pagedllm bench graph``: core's model as a tiny Llama (hidden 256, 4 layers, 8/4 heads, head_dim 32, fp32) decoding 64
sequences at context 64-96, torch 2.13. Two threads, quiet machine, best of 5 rounds: eager 8.3 ms/step;
torch.compile(dynamic=True) of the whole forward (attention left opaque) 9.1 ms after a 14.8 s cold compile.
One thread, CPU time: eager 12.3-13.8 ms; whole forward 13.9 ms (17.6 s compile); per decoder layer 14.2 ms (15.2 s);
norms+MLP only 13.2-15.5 ms (11.6 s). The step is bound by matmuls and the KV gather, which inductor does not
improve, and any compile breaks the 5 s cold-start target; a CPU has no launch overhead for graphs to amortize.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backend.hookspec import GraphRunner

#: What ``Capabilities.graph_capture`` reports: nothing is captured.
CAPTURE_LEVEL = "none"


def make_runner(model: Any, max_num_seqs: int, device: torch.device) -> GraphRunner:
    """Run the model eagerly: ``run`` is the model itself."""
    return GraphRunner(run=model, level="none", stats={"strategy": "eager"})
