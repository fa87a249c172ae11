"""Simulated HPU memory stats: ``Limit`` is a Gaudi 2's 96 GiB (``HABANA_SIM_HBM_BYTES``), ``InUse`` the process
RSS, ``MaxInUse`` the largest RSS sampled (at mark_step and memory queries) since ``reset_peak_memory_stats``.
Keys and derived functions as gaudi-pytorch-bridge python_packages/habana_frameworks/torch/hpu/memory.py."""

import os

_state = {"max_in_use": 0}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sample() -> int:
    now = _rss()
    _state["max_in_use"] = max(_state["max_in_use"], now)
    return now


def memory_stats(device=None) -> dict:
    in_use = sample()
    return {"Limit": int(os.environ.get("HABANA_SIM_HBM_BYTES", 96 << 30)), "InUse": in_use,
            "MaxInUse": _state["max_in_use"]}


def memory_allocated(device=None) -> int:
    return memory_stats(device)["InUse"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["MaxInUse"]


def reset_peak_memory_stats(device=None) -> None:
    _state["max_in_use"] = _rss()


def mem_get_info(device=None) -> tuple:
    s = memory_stats(device)
    return s["Limit"] - s["InUse"], s["Limit"]
