"""HPU graphs through core's ``StaticGraphRunner``, and where ``mark_step`` goes.

Capture: one ``HPUGraph`` per bucket program, captured over the runner's persistent buffers inside
``htorch.hpu.graph(g)`` and replayed with ``g.replay()`` (API: HabanaAI/gaudi-pytorch-bridge
python_packages/habana_frameworks/torch/hpu/graphs.py ``HPUGraph``, ``graph``; Intel Gaudi docs "Run Inference
Using HPU Graphs"). The graph keeps its input and output addresses, which is what the runner's per-bucket buffers
give it. vllm-gaudi reaches the same with ``wrap_in_hpu_graph(model, disable_tensor_cache=True)`` in lazy mode
(vllm_gaudi/v1/worker/hpu_model_runner.py ``_maybe_wrap_in_hpu_graph``), which caches one graph per input-shape
hash; core's runner already keys programs by bucket, so the lower-level class is enough.

``mark_step`` (``habana_frameworks.torch.core.mark_step``) cuts the lazy-mode op accumulation into a graph launch.
Placement follows vllm-gaudi (vllm_gaudi/v1/worker/hpu_model_runner.py): in lazy mode a forward hook on every
``*DecoderLayer`` calls it after the layer (``modify_model_layers``; every ``VLLM_CONFIG_HIDDEN_LAYERS``-th layer,
default 1), so the bridge compiles one layer-sized graph that all layers reuse instead of one whole-model graph per
shape; and one more ends each step, after the forward (+ logits + sampling), before the host reads the result
(``_run_sampling`` marks a step around the sampler). Inside a captured HPU graph the bridge handles it implicitly
(the docs' "Adding mark_step is not required with HPU Graphs"), so replays add only the end-of-step call.

Not verified on hardware.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from pagedllm.backend.hookspec import GraphRunner, RunnerContext
from pagedllm.backend.static_runner import make_static_runner
from pagedllm_gaudi import vendor

LAYER_SUFFIX = "DecoderLayer"  # vllm-gaudi get_target_layer_suffix_list's default


def hpu_graph_capture(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Capture ``fn`` (which reads only persistent buffers) into an HPU graph; return its replay."""
    hpu = vendor.hpu()
    graph = hpu.HPUGraph()
    with hpu.graph(graph):  # capture on the bridge's side stream
        out = fn()

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def hidden_layer_interval() -> int:
    try:
        return max(1, int(os.environ.get("VLLM_CONFIG_HIDDEN_LAYERS", "1")))
    except ValueError:
        return 1


def add_layer_mark_steps(model: torch.nn.Module) -> int:
    """Register the per-layer ``mark_step`` hooks once per model (lazy mode only); returns how many layers got one."""
    if getattr(model, "_gaudi_mark_steps", None) is not None:
        return model._gaudi_mark_steps
    count = 0
    if vendor.is_lazy():
        n = hidden_layer_interval()
        layers = [m for m in model.modules() if type(m).__name__.endswith(LAYER_SUFFIX)]
        for i, layer in enumerate(layers, start=1):
            if i % n == 0:
                layer.register_forward_hook(lambda mod, args, out: (vendor.mark_step(), out)[1])
                count += 1
    model._gaudi_mark_steps = count
    return count


def _end_of_step(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: Any) -> torch.Tensor:
        out = fn(*args)
        vendor.mark_step()
        return out

    return run


def make_runner(model: Any, ctx: RunnerContext) -> GraphRunner:
    """Core's static runner with HPU-graph capture (``PAGEDLLM_DISABLE_GRAPHS=1``: replay re-executes eagerly, as
    vllm-gaudi's ``bypass_hpu_graphs``), a step-ending ``mark_step`` around ``run`` and ``sample``."""
    add_layer_mark_steps(model)
    eager = os.environ.get("PAGEDLLM_DISABLE_GRAPHS", "0") not in ("", "0")
    capture = (lambda fn: fn) if eager else hpu_graph_capture
    runner = make_static_runner(model, ctx, capture=capture, level="none" if eager else "full")
    runner.run = _end_of_step(runner.run)
    runner.sample = _end_of_step(runner.sample) if runner.sample is not None else None
    runner.stats["capture"] = "eager" if eager else "hpu_graph"
    runner.stats["layer_mark_steps"] = model._gaudi_mark_steps
    return runner
