"""Contract v2's import paths, kept for one contract version after issue 27 moved them.

Each old module path still imports and gives the new module's names, with one ``DeprecationWarning`` naming the new
path; so do the old names of modules that became packages (``pagedllm.worker``, ``pagedllm.engine``) and
``pagedllm.sampling_params.ParamError``. Installed by ``import pagedllm``; removed once core stops loading contract-v2
plugins (contract v4), which may import them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

#: old module path -> new module path
OLD_MODULES = {
    "pagedllm.hookspec": "pagedllm.backend.hookspec",
    "pagedllm.backends": "pagedllm.backend.registry",
    "pagedllm.reference_plugin": "pagedllm.backend.reference",
    "pagedllm.ref_ops": "pagedllm.backend.ref_ops",
    "pagedllm.attention": "pagedllm.backend.attention",
    "pagedllm.batch_policy": "pagedllm.backend.batch_policy",
    "pagedllm.static_runner": "pagedllm.backend.static_runner",
    "pagedllm.device_sampler": "pagedllm.backend.device_sampler",
    "pagedllm.kv_quant": "pagedllm.backend.kv_quant",
    "pagedllm.executor.binding": "pagedllm.distributed.binding",
    "pagedllm.kernels.graph_runner": "pagedllm.backend.graph_runner",
    "pagedllm.kernels.torch_cuda": "pagedllm.backend.accelerator",
    "pagedllm.kernels.attention": "pagedllm.backend.triton.attention",
    "pagedllm.kernels.aot_check": "pagedllm.backend.triton.aot_check",
    "pagedllm.kernels.fp8": "pagedllm.backend.triton.fp8",
    "pagedllm.kernels.fused_ops": "pagedllm.backend.triton.fused_ops",
    "pagedllm.kernels.kv_write": "pagedllm.backend.triton.kv_write",
    "pagedllm.kernels.ops_plugin": "pagedllm.backend.triton.hooks",
    "pagedllm.kernels": "pagedllm.backend.triton",
    "pagedllm.scheduler": "pagedllm.sched.scheduler",
    "pagedllm.kv_manager": "pagedllm.sched.kv_manager",
    "pagedllm.request": "pagedllm.sched.request",
    "pagedllm.model_runner": "pagedllm.worker.model_runner",
    "pagedllm.sampler": "pagedllm.sample.sampler",
    "pagedllm.greedy": "pagedllm.sample.greedy",
    "pagedllm.output_processor": "pagedllm.engine.output_processor",
    "pagedllm.detokenizer": "pagedllm.engine.detokenizer",
    "pagedllm.entrypoints.engine_core": "pagedllm.engine.core_process",
    "pagedllm.entrypoints.async_engine": "pagedllm.engine.async_engine",
    "pagedllm.entrypoints.dp_client": "pagedllm.engine.dp_client",
    "pagedllm.entrypoints.dp_lockstep": "pagedllm.engine.dp_lockstep",
    "pagedllm.entrypoints.cpu_split": "pagedllm.engine.cpu_split",
    "pagedllm.llm": "pagedllm.entrypoints.llm",
    "pagedllm.beam_search": "pagedllm.entrypoints.beam_search",
    "pagedllm.entrypoints.api_server": "pagedllm.entrypoints.openai.api_server",
    "pagedllm.entrypoints.auth": "pagedllm.entrypoints.openai.auth",
    "pagedllm.entrypoints.errors": "pagedllm.entrypoints.openai.errors",
    "pagedllm.entrypoints.extra_fields": "pagedllm.entrypoints.openai.extra_fields",
    "pagedllm.entrypoints.limits": "pagedllm.entrypoints.openai.limits",
    "pagedllm.entrypoints.metrics": "pagedllm.entrypoints.openai.metrics",
    "pagedllm.entrypoints.protocol": "pagedllm.entrypoints.openai.protocol",
    "pagedllm.entrypoints.render_pool": "pagedllm.entrypoints.openai.render_pool",
    "pagedllm.entrypoints.render_worker": "pagedllm.entrypoints.openai.render_worker",
    "pagedllm.entrypoints.serving_chat": "pagedllm.entrypoints.openai.serving_chat",
    "pagedllm.entrypoints.serving_common": "pagedllm.entrypoints.openai.serving_common",
    "pagedllm.entrypoints.serving_completions": "pagedllm.entrypoints.openai.serving_completions",
    "pagedllm.entrypoints.tool_calling": "pagedllm.entrypoints.openai.tool_calling",
}

#: old ``module.name`` spellings served by a package's ``__getattr__``: old module -> the module that holds its names
OLD_PACKAGE_NAMES = {"pagedllm.engine": "pagedllm.engine.llm_engine", "pagedllm.worker": "pagedllm.worker.worker"}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new} (pagedllm issue 27); the old path goes with contract v3",
                  DeprecationWarning, stacklevel=3)


def moved(old: str, new: str, obj: Any) -> Any:
    """Return ``obj`` after warning that ``old`` is now ``new``."""
    _warn(old, new)
    return obj


def package_attr(package: str, name: str) -> Any:
    """An old top-level name of a module that became ``package`` (``pagedllm.worker.dummy_metadata``...)."""
    home = OLD_PACKAGE_NAMES[package]
    obj = getattr(importlib.import_module(home), name, None)
    if obj is None or name.startswith("__"):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{home}.{name}")
    setattr(sys.modules[package], name, obj)  # one warning per name, not one per lookup
    return obj


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as a module holding the new module's names (same objects)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in OLD_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = OLD_MODULES[module.__name__]
        _warn(module.__name__, new)
        target = importlib.import_module(new)
        module.__dict__.update({k: v for k, v in vars(target).items()
                                if not k.startswith("__") or k in ("__all__", "__doc__")})
        if hasattr(target, "__path__"):
            module.__path__ = []  # a package: its old submodule paths resolve through OLD_MODULES too
        module.__getattr__ = lambda name: getattr(target, name)


def install() -> None:
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
