"""Run one ``sim_xpu.scenarios`` scenario in a fresh interpreter and return its JSON result (tests call this)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

SIM_ROOT = Path(__file__).resolve().parent.parent  # tests/support/sim/xpu


def run_scenario(name: str, *args: str, extra_path: Sequence[str] = (), env: Optional[dict] = None,
                 interpret: bool = True, timeout: float = 300) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDLLM_XPU_GRAPHS")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(SIM_ROOT), *map(str, extra_path)])
    if interpret:
        full_env["TRITON_INTERPRET"] = "1"
    full_env.update(env or {})
    res = subprocess.run([sys.executable, "-m", "sim_xpu.scenarios", name, *args], env=full_env,
                         capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        raise AssertionError(f"scenario {name} exited {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
    return json.loads(lines[-1])
