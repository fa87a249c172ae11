"""The simulated ``npu`` device: torch's pure-Python PrivateUse1 backend, renamed ``npu``.

Every ``npu`` tensor is an :class:`NPUTensor`, a wrapper subclass holding a CPU tensor (``raw``) with the same
shape, strides and storage offset. Factory ops on ``device="npu"`` reach a PrivateUse1 fallback that runs them on
the CPU and wraps the result; every op on wrappers goes through ``__torch_dispatch__``, which unwraps, runs on the
CPU and wraps again, so views share storage and in-place ops mutate the device copy, as on a device. An op mixing
``npu`` tensors with non-scalar CPU tensors raises, like a real device (copies, and CPU index tensors, which CUDA
also accepts, excepted). Bytes held by live device storages are counted for ``torch.npu.mem_get_info`` and the peak.

See PyTorch's test/test_privateuseone_python_backend.py for the route
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``); one device name per process.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

aten = torch.ops.aten
#: Ops that may legitimately see both devices (copies) or take CPU index tensors (as CUDA does).
_MIXED_OK = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
             aten.index_put.default, aten._index_put_impl_.default, aten._copy_from.default}


class _Memory:
    """Bytes held by live device storages (refcounted by wrapper), and the peak since the last reset."""

    def __init__(self) -> None:
        self.storages: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live wrappers]
        self.allocated = 0
        self.peak = 0

    def track(self, t: "NPUTensor") -> None:
        st = t.raw.untyped_storage()
        key = st.data_ptr()
        entry = self.storages.get(key)
        if entry is None:
            entry = self.storages[key] = [st.nbytes(), 0]
            self.allocated += entry[0]
            self.peak = max(self.peak, self.allocated)
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.allocated -= entry[0]
            del self.storages[key]


MEMORY = _Memory()


class NPUTensor(torch.Tensor):
    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor) -> "NPUTensor":
        r = torch.Tensor._make_wrapper_subclass(cls, raw.shape, strides=raw.stride(),
                                                storage_offset=raw.storage_offset(), dtype=raw.dtype,
                                                device=_DEVICE[0], requires_grad=raw.requires_grad)
        r.raw = raw
        MEMORY.track(r)
        return r

    def tolist(self) -> Any:  # torch refuses tolist() on subclasses; a device tensor copies to the host
        from torch_npu._graph import capturing

        if capturing():
            raise RuntimeError("tolist() of an npu tensor inside an ACL graph capture (simulated npu)")
        return self.raw.tolist()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"{self.raw!r} (simulated npu)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _MIXED_OK:
            _check_same_device(func, args, kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func._schema.is_mutable:
            _check_not_resized(func, args, kwargs)
        if func is aten._to_copy.default and _target_is_cpu(kwargs):
            return out
        return tree_map(_wrap, out)


def _check_same_device(func, args, kwargs) -> None:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
    if any(type(t) is not NPUTensor and t.device.type == "cpu" and t.dim() > 0 for t in found):
        raise RuntimeError(f"{func}: Expected all tensors to be on the same device, but found at least two "
                           "devices, npu:0 and cpu! (simulated npu)")


def _check_not_resized(func, args, kwargs) -> None:
    def check(x: Any) -> None:
        if isinstance(x, NPUTensor) and x.shape != x.raw.shape:
            raise RuntimeError(f"{func} resized an npu tensor in place: the simulated device cannot follow that; "
                               "register the op whole in tests/support/sim/torch_npu/_device.py")

    tree_map(check, (args, kwargs))


def _target_is_cpu(kwargs) -> bool:
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == "cpu"


def _unwrap(x: Any) -> Any:
    if isinstance(x, NPUTensor):
        return x.raw
    if isinstance(x, torch.device) and x.type == "npu":
        return torch.device("cpu")
    return x


def _wrap(x: Any) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, NPUTensor):
        return x
    # Never an inference tensor: a view of a normal tensor taken under inference_mode must be normal too (autograd
    # shares the base's version counter with it), and the wrapper cannot tell which case it is in.
    with torch.inference_mode(False):
        return NPUTensor(x)


def raw(x: Any) -> Any:
    """The CPU tensor behind a device tensor (the simulated kernels compute on it)."""
    return x.raw if isinstance(x, NPUTensor) else x


def _factory_fallback(op, *args, **kwargs):
    """Ops dispatched to PrivateUse1 without a wrapper input (``torch.empty(..., device="npu")`` and friends)."""
    kwargs.pop("pin_memory", None)
    return tree_map(_wrap, op(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))


def _arange(*args, **kwargs):
    """``arange`` is composite (``empty`` then ``arange.out``, which resizes): a wrapper cannot follow a resize of
    its CPU tensor, so arange runs whole on the CPU and is wrapped once."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
    return _wrap(torch.arange(*args, **kwargs))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    raw(dst).copy_(raw(src))
    return dst


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_LIBS: list = []
_DEVICE: list = []  # torch.device("npu", 0), once the name exists


def setup(backend_module: Any) -> None:
    """Rename PrivateUse1 to ``npu`` and register ``backend_module`` as ``torch.npu`` (once per process)."""
    if getattr(torch, "npu", None) is not None:
        return
    _setup_privateuseone_for_python_backend("npu", backend_module=backend_module, hook=_Hooks())
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_factory_fallback, dispatch_key="PrivateUse1")
    impl = torch.library.Library("aten", "IMPL")
    impl.impl("_copy_from", _copy_from, "PrivateUse1")
    for overload in ("arange", "arange.start", "arange.start_step"):
        impl.impl(overload, _arange, "PrivateUse1")
    _LIBS.extend([fallback, impl])  # keep the registrations alive
    _DEVICE.append(torch.device("npu", 0))
