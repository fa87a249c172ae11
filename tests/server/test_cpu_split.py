"""``pagedllm serve --engine-cpus``: the engine process (every thread of it) and the HTTP process on disjoint CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from pagedllm.engine.cpu_split import parse_cpu_list
from pagedllm.errors import ParamError
from server_utils import API_KEY, ServerProcess, children, cmdline, tiny_chat_model, wait_idle


def test_parse_cpu_list():
    cpus = sorted(os.sched_getaffinity(0))
    assert parse_cpu_list(str(cpus[0])) == {cpus[0]}
    assert parse_cpu_list(",".join(map(str, cpus))) == set(cpus)
    assert parse_cpu_list(f"{cpus[0]}-{cpus[0]}") == {cpus[0]}
    for bad in ("", "x", "1-", "-1", "3-1", "0,,1"):
        with pytest.raises(ParamError) as e:
            parse_cpu_list(bad)
        assert e.value.field == "engine_cpus", bad
    with pytest.raises(ParamError, match="not available"):
        parse_cpu_list(str(max(cpus) + 1000))


def _thread_affinities(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_serve_engine_cpus_splits_the_processes():
    cpus = sorted(os.sched_getaffinity(0))
    srv = ServerProcess(tiny_chat_model(), "--engine-cpus", str(cpus[0]))
    try:
        r = httpx.post(f"{srv.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                       json={"model": "test-model", "prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        engines = [c for c in children(srv.proc.pid) if "spawn_main" in cmdline(c)]
        assert len(engines) == 1
        assert {frozenset(a) for a in _thread_affinities(engines[0])} == {frozenset([cpus[0]])}
        if len(cpus) > 1:  # the whole HTTP process (event loop, libuv workers, import-time helpers) moved off it
            assert {frozenset(a) for a in _thread_affinities(srv.proc.pid)} == {frozenset(cpus[1:])}
        assert "1 torch threads" in srv.output()
        wait_idle(srv.base_url)
    finally:
        srv.stop()
