"""``pagedllm bench paged-attention`` on the CPU plugin's kernel: its output checked against core's reference, its
rate set against the plugin's streaming-read floor, and a pool too small for the batch refused naming the flag."""

from __future__ import annotations

import json

from pagedllm.cli import main

SMALL = ["bench", "paged-attention", "--batch", "3", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32",
         "--block-size", "8", "--repeats", "2"]


def test_bench_reports_each_context_against_the_floor(lib, capsys):
    assert main(SMALL + ["--context-lens", "5,40", "--pool-gib", "0.01", "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in out["rows"]] == [5, 40]
    assert out["stream_read_gb_s"] > 0
    for r in out["rows"]:
        assert r["max_abs_err"] <= 1e-4 and r["ms"] > 0 and r["floor_ms"] > 0 and r["floor_reached_pct"] > 0
        assert r["kv_mb"] == round(3 * r["context"] * 2 * 2 * 32 * 4 / 1e6, 1)


def test_a_pool_too_small_for_two_calls_is_refused(lib, capsys):
    assert main(SMALL + ["--context-lens", "40", "--pool-gib", "0.00002"]) == 2
    assert "--pool-gib" in capsys.readouterr().out
