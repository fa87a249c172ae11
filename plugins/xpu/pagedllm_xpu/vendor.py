"""The one place intel-extension-for-pytorch (the ``ipex`` backend's vendor SDK) is imported, and only after its
metadata alone says it may be.

Each IPEX release is built against one torch major.minor (IPEX 2.8 needs torch 2.8) and refuses to load beside
any other: importing it with a mismatched torch can end the process, so a plugin that imports it blindly breaks
``pagedllm backends`` or even the interpreter. The rule here: read the installed version with
``importlib.metadata`` (no import), compare its major.minor with torch's, and only then import — catching even
``SystemExit`` from the import, so the worst case is a refusal with a reason.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

DIST = "intel-extension-for-pytorch"
MODULE = "intel_extension_for_pytorch"


class IpexUnavailable(RuntimeError):
    """IPEX is missing, built for another torch, or failed to import."""


@dataclass(frozen=True)
class IpexStatus:
    ok: bool
    reason: str = ""
    version: str = ""


def _major_minor(version: str) -> Optional[tuple[int, int]]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check(torch_version: Optional[str] = None) -> IpexStatus:
    """Whether the installed IPEX may be imported beside this torch (never imports it)."""
    torch_version = torch_version or torch.__version__
    try:
        version = md.version(DIST)
    except md.PackageNotFoundError:
        return IpexStatus(False, f"{DIST} is not installed (it is optional; install the build made for torch "
                                 f"{'.'.join(map(str, _major_minor(torch_version) or ()))}: docs/backends/xpu.md)")
    ipex_mm, torch_mm = _major_minor(version), _major_minor(torch_version)
    if ipex_mm is None or ipex_mm != torch_mm:
        return IpexStatus(False, f"{DIST} {version} is built for torch {'.'.join(map(str, ipex_mm or ('?',)))}.x, "
                                 f"this is torch {torch_version}: not imported (importing a mismatched IPEX exits "
                                 f"the process); install the matching pair", version)
    if version.endswith("xpu"):
        return IpexStatus(False, f"{DIST} {version} is the XPU build; the ipex backend runs the CPU build "
                                 "(Intel GPUs use the xpu backend)", version)
    return IpexStatus(True, "", version)


_loaded: dict[str, Any] = {}


def load() -> Any:
    """Import IPEX after :func:`check` allows it; raise :class:`IpexUnavailable` (never ``SystemExit``) otherwise."""
    if "module" in _loaded:
        return _loaded["module"]
    status = check()
    if not status.ok:
        raise IpexUnavailable(status.reason)
    try:
        module = importlib.import_module(MODULE)
    except BaseException as e:  # IPEX may sys.exit() on a torch it was not built for
        if isinstance(e, KeyboardInterrupt):
            raise
        raise IpexUnavailable(f"importing {MODULE} {status.version} failed: {type(e).__name__}: {e}") from None
    paged = getattr(getattr(getattr(module, "llm", None), "modules", None), "PagedAttention", None)
    if paged is None:
        raise IpexUnavailable(f"{MODULE} {status.version} has no llm.modules.PagedAttention (needs IPEX >= 2.3)")
    _loaded["module"] = module
    return module


def paged_attention_ops() -> Any:
    """``ipex.llm.modules.PagedAttention`` (reshape_and_cache, single_query_cached_kv_attention,
    flash_attn_varlen_func)."""
    return load().llm.modules.PagedAttention
