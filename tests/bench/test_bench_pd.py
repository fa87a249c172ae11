"""``pagedllm bench pd`` at its smallest size on the tiny model, as a real process: it starts the colocated server,
then the prefill and decode instances and the router, drives the mixed load through each, and reports the CPU, the
thread split and per-setup latencies; afterwards no server it started is left running, and no transfer folder. A
server that cannot start is an error naming its log, never a hang."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
import time

import pytest
from server_utils import cmdline, tiny_chat_model

from pagedllm.bench.pd import FIELDS, SETUPS, cpu_kind

BENCH = [sys.executable, "-m", "pagedllm.cli", "bench", "pd"]
SMALL = ["--rounds", "1", "--decode-streams", "2", "--num-decode", "2", "--decode-input-len", "16",
         "--decode-output-len", "6", "--num-long", "2", "--long-len", "160", "--long-output-len", "2",
         "--long-rate", "20", "--start-timeout", "180", "--request-timeout", "60", "--load-timeout", "120"]


def running_with(marker: str) -> list[str]:
    """Command lines of live processes carrying ``marker`` (a unique seed in the servers' flags)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            line = cmdline(int(pid))
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in line and state not in ("Z", "X") and "pytest" not in line:
            out.append(line)
    return out


def shm_stores() -> set[str]:
    return set(glob.glob("/dev/shm/bench-pd-kv-*"))


@pytest.mark.slow
def test_bench_pd_smallest_size_reports_both_setups(tmp_path):
    marker = f"--seed {random.randrange(10**8, 10**9)}"
    out_json = tmp_path / "pd.json"
    stores = shm_stores()
    done = subprocess.run([*BENCH, "--model", tiny_chat_model(), "--serve-args",
                           f"--device cpu --max-model-len 256 {marker}", *SMALL, "--json", str(out_json)],
                          capture_output=True, text=True, timeout=420,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model, flags = cpu_kind()
    lines = done.stdout.splitlines()
    assert lines[0] == f"CPU: {model}; ISA flags: {' '.join(flags) or 'none'}"
    assert lines[1].startswith("threads: colocated engine on CPUs") and "prefill engine on CPUs" in lines[1] \
        and "OMP_NUM_THREADS" in lines[1]
    assert any(ln.startswith("colocated / P/D") for ln in lines)

    report = json.loads(out_json.read_text())
    assert report["cpu"] == model and report["cpu_flags"] == flags
    cpus = report["cpus"]
    assert cpus["colocated"] == sorted(cpus["prefill"] + cpus["decode"]) and cpus["prefill"] and cpus["decode"]
    assert not set(cpus["prefill"]) & set(cpus["decode"])
    for setup in SETUPS:
        (run,) = report["rounds"][setup]
        assert run["failed"] == 0 and run["errors"] == []
        # 2 streams x 6 tokens + 2 long prompts x 2 tokens, all streamed back
        assert run["output_tokens"] == 2 * 6 + 2 * 2
        for f in FIELDS:
            assert run[f] > 0 and report["median"][setup][f] == run[f], (setup, f)
        assert run["itl_p99_ms"] >= run["itl_p50_ms"] and run["ttft_p99_ms"] >= run["ttft_p50_ms"]
    for f in FIELDS:
        c, p = report["rounds"]["colocated"][0][f], report["rounds"]["pd"][0][f]
        assert report["colocated_over_pd"][f] == pytest.approx(c / p)
    pd = report["rounds"]["pd"][0]
    # the decode instance loaded the long prompts' blocks (and the short ones' first block) instead of computing them
    assert pd["decode_loaded_blocks"] >= 2 * (160 // 16 - 1) and pd["decode_load_errors"] == 0
    assert running_with(marker) == [] and shm_stores() <= stores


def test_bench_pd_a_server_that_cannot_start_is_an_error_naming_its_log():
    marker = f"--seed {random.randrange(10**8, 10**9)}"
    t0 = time.monotonic()
    done = subprocess.run([*BENCH, "--model", tiny_chat_model(), "--serve-args",
                           f"--device cpu {marker} --no-such-flag", *SMALL], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0 and time.monotonic() - t0 < 170
    assert "did not come up (log " in done.stderr and "--no-such-flag" in done.stderr, done.stderr[-2000:]
    assert running_with(marker) == []


def test_cpu_split_and_ratios():
    """P and D get disjoint halves of the CPUs the colocated engine gets; ratios are colocated / P/D per round."""
    from pagedllm.bench.pd import cpu_split, summarize

    cpus = sorted(os.sched_getaffinity(0))
    both, p, d = cpu_split(None)
    assert both == cpus and p + d == cpus and len(p) == len(cpus) // 2 and p and d
    assert cpu_split(f"{cpus[0]},{cpus[1]}") == ([cpus[0], cpus[1]], [cpus[0]], [cpus[1]])
    with pytest.raises(SystemExit, match="at least 2 CPUs"):
        cpu_split(str(cpus[0]))
    run = {f: 10.0 for f in FIELDS}
    runs = {"colocated": [dict(run, itl_p99_ms=40.0), dict(run, itl_p99_ms=60.0)],
            "pd": [dict(run, itl_p99_ms=10.0), dict(run, itl_p99_ms=30.0)]}
    s = summarize(runs)
    assert s["median"]["colocated"]["itl_p99_ms"] == 50.0 and s["median"]["pd"]["itl_p99_ms"] == 20.0
    assert s["colocated_over_pd"]["itl_p99_ms"] == 3.0 and s["colocated_over_pd"]["output_tok_s"] == 1.0
