"""``pagedllm backends``: every discovered backend, whether it is usable here, and why not."""

from __future__ import annotations

import argparse
import json
import textwrap

from pagedllm.backend import registry


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="list installed backends and whether they are usable here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    """Installed backends (probed), then every backend extra of ours that is not installed, with how to get it."""
    out = []
    found = registry.discover()
    for name, d in sorted(found.items()):
        if d.backend is None:
            out.append({"name": name, "distribution": d.distribution, "loaded": False, "usable": False,
                        "priority": None, "device_type": None, "reason": f"failed to load: {d.error}"})
            continue
        b, probe = d.backend, d.backend.probe
        out.append({"name": name, "distribution": d.distribution, "loaded": True, "usable": probe.usable,
                    "priority": b.info.priority, "device_type": b.info.device_type, "api_version": b.info.api_version,
                    "device_name": probe.device_name, "reason": probe.reason,
                    "quantization": list(b.capabilities.quantization),
                    "kv_cache_dtypes": list(b.capabilities.kv_cache_dtypes), "kv_cache_groups": kv_cache_groups(b)})
    installed = {d.backend.info.extra for d in found.values() if d.backend is not None} | set(found)
    for extra in registry.known_extras():
        if extra not in installed:
            out.append({"name": extra, "distribution": "", "loaded": False, "usable": False, "priority": None,
                        "device_type": None, "reason": f"not installed: pip install \"pagedllm[{extra}]\""})
    return out


def kv_cache_groups(backend: registry.Backend) -> str:
    """``own``: the backend allocates the KV cache groups itself (contract v4's
    ``pagedllm_allocate_kv_cache_groups``); ``reference``: core builds them from its allocate_kv_cache /
    allocate_state_cache (its own or core's), as for a v3 plugin."""
    return "own" if backend.implements("pagedllm_allocate_kv_cache_groups") else "reference"


KV_GROUPS_TEXT = {"own": "own allocator", "reference": "core's reference allocator"}
WIDTH = 100  # the table's width: an 80-100 column terminal shows it unwrapped; long reasons wrap under "detail"


def table(data: list[dict], width: int = WIDTH) -> str:
    """One row per backend; the detail (device, or why it is unusable; quantization methods; who allocates the KV
    cache groups) wraps within ``width``."""
    head = f"{'backend':<11}{'usable':<7}{'prio':>4}  {'distribution':<17}"
    lines = [head + "detail"]
    for r in data:
        prio = "" if r["priority"] is None else r["priority"]
        detail = (r.get("device_name") or "usable") if r["usable"] else r["reason"]
        if r["usable"] and r.get("quantization"):
            detail += "; quantization: " + ", ".join(r["quantization"])
        if r["usable"] and r.get("kv_cache_groups"):
            detail += "; KV cache groups: " + KV_GROUPS_TEXT[r["kv_cache_groups"]]
        left = f"{r['name']:<11}{'yes' if r['usable'] else 'no':<7}{prio:>4}  {r['distribution']:<17}"
        wrapped = textwrap.wrap(detail, width - len(head), break_on_hyphens=False) or [""]
        lines.append(left + wrapped[0])
        lines += [" " * len(head) + w for w in wrapped[1:]]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    data = rows()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    if not data:
        print('no backends installed: pip install "pagedllm[cpu]"')
        return 0
    print(table(data), end="")
    return 0
