"""Simulated HPU graphs with reference semantics: capture records every aten op of the region (inputs, outputs,
in-place updates) and replay re-runs them in order on the *same* tensors, copying each result into the tensor the
capture produced, so outputs keep their addresses as on the device. Python code in the region does not run again on
replay: a value computed on the host during capture stays frozen, exactly the bug a real HPU graph would have.
Ops that need the host (``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing) raise
during capture, as the Intel docs say of HPU graphs ("Data Dependent dynamic flow is not supported")."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from habana_frameworks.torch import _sim

aten = torch.ops.aten
HOST_SYNC = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal, aten.masked_select, aten._unique2,
             aten.unique_dim, aten.unique_consecutive, aten.nonzero_static}


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in HOST_SYNC:
            raise RuntimeError(f"{func} is not supported during HPU Graph capturing (simulated): it reads device "
                               f"values on the host or has a data-dependent shape")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class HPUGraph:
    def __init__(self):
        self.ops: list = []
        self._mode = None
        self.captured = False

    def capture_begin(self):
        self._mode = _Recorder(self.ops)
        self._mode.__enter__()

    def capture_end(self):
        self._mode.__exit__(None, None, None)
        self._mode = None
        self.captured = True
        _sim.STATS["captures"] += 1
        _sim.STATS["recorded_ops"] += len(self.ops)

    def replay(self):
        if not self.captured:
            raise RuntimeError("HPUGraph.replay() before capture_end()")
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(tree_leaves(out), tree_leaves(new)):
                if isinstance(o, torch.Tensor) and o is not n and not _same_storage(o, n):
                    o.copy_(n)
        _sim.STATS["replays"] += 1


class graph:
    """``with graph(g): ...`` captures the body into ``g`` (on a side stream in the real bridge)."""

    def __init__(self, hpu_graph, stream=None):
        self.hpu_graph = hpu_graph

    def __enter__(self):
        self.hpu_graph.capture_begin()

    def __exit__(self, exc_type, exc, tb):
        self.hpu_graph.capture_end()
