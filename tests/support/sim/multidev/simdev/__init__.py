"""A SIMULATED multi-device accelerator ``simdev`` (tests only): see README.md. Importing it makes
``torch.device("simdev", i)`` work and ``torch.simdev`` the device module."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

aten = torch.ops.aten
COUNT = int(os.environ.get("SIMDEV_COUNT", "4"))
#: Every ``torch.simdev.set_device`` call of this process, in order (the tests read it).
SET_DEVICE_CALLS: list[int] = []
_current = 0
_MIXED_OK = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
             aten.index_put.default, aten._index_put_impl_.default, aten._copy_from.default}


class SimTensor(torch.Tensor):
    raw: torch.Tensor

    @staticmethod
    def __new__(cls, raw: torch.Tensor, index: int) -> "SimTensor":
        r = torch.Tensor._make_wrapper_subclass(cls, raw.shape, strides=raw.stride(),
                                                storage_offset=raw.storage_offset(), dtype=raw.dtype,
                                                device=torch.device("simdev", index), requires_grad=raw.requires_grad)
        r.raw = raw
        return r

    def tolist(self) -> Any:
        return self.raw.tolist()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"{self.raw!r} (simulated {self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found: list[torch.Tensor] = []
        tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, (args, kwargs))
        indices = {t.device.index for t in found if isinstance(t, SimTensor)}
        if func not in _MIXED_OK:
            if len(indices) > 1 or any(type(t) is not SimTensor and t.dim() > 0 for t in found):
                raise RuntimeError(f"{func}: Expected all tensors to be on the same device, found "
                                   f"{sorted(indices)} and cpu (simulated simdev)")
        index = _target_index(kwargs, min(indices) if indices else _current)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is aten._to_copy.default and _target_is_cpu(kwargs):
            return out
        return tree_map(lambda x: _wrap(x, index), out)


def _target_index(kwargs: dict, default: int) -> int:
    dev = kwargs.get("device")
    if dev is None or torch.device(dev).type != "simdev":
        return default
    idx = torch.device(dev).index
    return _current if idx is None else _check(idx)


def _target_is_cpu(kwargs: dict) -> bool:
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == "cpu"


def _unwrap(x: Any) -> Any:
    if isinstance(x, SimTensor):
        return x.raw
    if isinstance(x, torch.device) and x.type == "simdev":
        return torch.device("cpu")
    return x


def _wrap(x: Any, index: int) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, SimTensor):
        return x
    with torch.inference_mode(False):
        return SimTensor(x, index)


def _factory_fallback(op, *args, **kwargs):
    kwargs.pop("pin_memory", None)
    index = _target_index(kwargs, _current)
    return tree_map(lambda x: _wrap(x, index), op(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))


def _arange(*args, **kwargs):
    index = _target_index(kwargs, _current)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
    return _wrap(torch.arange(*args, **kwargs), index)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    (dst.raw if isinstance(dst, SimTensor) else dst).copy_(src.raw if isinstance(src, SimTensor) else src)
    return dst


def _check(idx: Any) -> int:
    idx = int(idx)
    if not 0 <= idx < COUNT:
        raise RuntimeError(f"simulated simdev: invalid device index {idx} ({COUNT} devices)")
    return idx


# ---- torch.simdev -----------------------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def device_count() -> int:
    return COUNT


def current_device() -> int:
    return _current


def set_device(device: Any) -> None:
    global _current
    idx = getattr(device, "index", device)
    if idx is None:
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got: {device}")
    _current = _check(idx)
    SET_DEVICE_CALLS.append(_current)


def synchronize(device: Any = None) -> None:
    pass


def manual_seed_all(seed: int) -> None:
    pass


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_LIBS: list = []
if getattr(torch, "simdev", None) is None:
    _setup_privateuseone_for_python_backend("simdev", backend_module=sys.modules[__name__], hook=_Hooks())
    _fallback = torch.library.Library("_", "IMPL")
    _fallback.fallback(_factory_fallback, dispatch_key="PrivateUse1")
    _impl = torch.library.Library("aten", "IMPL")
    _impl.impl("_copy_from", _copy_from, "PrivateUse1")
    for _overload in ("arange", "arange.start", "arange.start_step"):
        _impl.impl(_overload, _arange, "PrivateUse1")
    _LIBS.extend([_fallback, _impl])
