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
                    "kv_cache_dtypes": list(b.capabilities.kv_cache_dtypes)})
    installed = {d.backend.info.extra for d in found.values() if d.backend is not None} | set(found)
    for extra in registry.known_extras():
        if extra not in installed:
            out.append({"name": extra, "distribution": "", "loaded": False, "usable": False, "priority": None,
                        "device_type": None, "reason": f"not installed: pip install \"pagedllm[{extra}]\""})
    return out


WIDTH = 100  # the table's width: an 80-100 column terminal shows it unwrapped; long reasons wrap under "detail"


def table(data: list[dict], width: int = WIDTH) -> str:
    """One row per backend; the detail (device, or why it is unusable; quantization methods) wraps within ``width``."""
    head = f"{'backend':<11}{'usable':<7}{'prio':>4}  {'distribution':<17}"
    lines = [head + "detail"]
    for r in data:
        prio = "" if r["priority"] is None else r["priority"]
        detail = (r.get("device_name") or "usable") if r["usable"] else r["reason"]
        if r["usable"] and r.get("quantization"):
            detail += "; quantization: " + ", ".join(r["quantization"])
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
