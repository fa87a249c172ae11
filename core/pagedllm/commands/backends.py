"""``pagedllm backends``: every discovered backend, whether it is usable here, and why not."""

from __future__ import annotations

import argparse
import json

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


def run(args: argparse.Namespace) -> int:
    data = rows()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'backend':<10} {'usable':<7} {'prio':>4}  {'distribution':<16} {'quantization':<13} detail")
    for r in data:
        detail = r.get("device_name") or "" if r["usable"] else r["reason"]
        prio = "" if r["priority"] is None else r["priority"]
        quant = ",".join(r.get("quantization") or []) or "-"
        print(f"{r['name']:<10} {'yes' if r['usable'] else 'no':<7} {prio:>4}  {r['distribution']:<16} {quant:<13} "
              f"{detail}")
    if not data:
        print("no backends installed: pip install pagedllm[cpu]")
    return 0
