"""The scale model's arithmetic (``pagedllm bench scale-model``), checked against hand-derived figures."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from pagedllm.bench.scale_model import (
    H100,
    LLAMA3_70B,
    Links,
    allgather_s,
    allreduce_s,
    crossing,
    measured,
    project,
    roofline,
)

M = LLAMA3_70B


def test_llama3_70b_shapes():
    # qkv 8192 x (64 + 2*8)*128, o 8192 x 8192, gate/up/down 3 x 8192 x 28672
    assert M.layer_params() == 8192 * 10240 + 8192 * 8192 + 3 * 8192 * 28672 == 855_638_016
    total = M.layers * M.layer_params() + 2 * M.vocab * M.hidden  # + untied embedding and LM head
    assert abs(total / 70.55e9 - 1) < 1e-3  # Llama-3-70B: 70.6 B parameters (norms are a rounding error)
    assert M.shard_shapes(8) == [(8192, 1280), (1024, 8192), (8192, 7168), (3584, 8192)]
    assert M.shard_shapes(16)[0] == (8192, (4 + 2) * 128)  # 8 kv heads over 16 ranks: replicated, one each


def test_collectives():
    links = Links()
    assert allreduce_s(1 << 20, 1, links) == 0.0
    assert allreduce_s(16384, 8, links) == pytest.approx(20e-6 + 2 * 7 / 8 * 16384 / 450e9)
    assert allgather_s(1e6, 4, links) == pytest.approx(20e-6 + 3 / 4 * 1e6 / 450e9)


def test_decode_tp8_by_hand():
    """Batch 1, context 2048, TP=8 on H100: memory bound; 161 all-reduces of 16 KiB + one logits all-gather."""
    links = Links()
    e = project(M, H100, links, tp=8, pp=1, phase="decode", tokens=1, ctx=2048)
    weights = M.layer_params() / 8 * 2
    kv = 2048 * 2 * 1 * 128 * 2  # one kv head per rank, K and V, bf16
    layer = max((2 * M.layer_params() / 8 + 4 * 2048 * 64 * 128 / 8) / 989e12, (weights + kv) / 3.35e12)
    assert layer == pytest.approx((weights + kv) / 3.35e12)  # bandwidth bound
    head = max(2 * 8192 * 128256 / 8 / 989e12, 8192 * 128256 / 8 * 2 / 3.35e12)
    assert e.compute_s == pytest.approx(80 * layer + head)
    ar = 20e-6 + 2 * 7 / 8 * 8192 * 2 / 450e9
    comm = 161 * ar + 20e-6 + 7 / 8 * 128256 * 4 / 450e9
    assert e.comm_s == pytest.approx(comm)
    assert e.step_s == pytest.approx(e.compute_s + e.comm_s)
    assert e.comm_share == pytest.approx(comm / (comm + e.compute_s))
    assert e.tokens_per_s == pytest.approx(1 / e.step_s)
    assert 5.0e-3 < e.compute_s < 5.5e-3 and 3.2e-3 < e.comm_s < 3.3e-3  # the doc's figures


def test_pipeline_adds_one_hop_and_doubles_throughput():
    links = Links()
    one = project(M, H100, links, 8, 1, "prefill", 2048)
    two = project(M, H100, links, 8, 2, "prefill", 2048)
    assert two.compute_s == one.compute_s
    assert two.comm_s - one.comm_s == pytest.approx(10e-6 + 2048 * 8192 * 2 / 50e9)
    assert two.tokens_per_s == pytest.approx(2 * 2048 / two.step_s)
    # prefill attention: each of 2048 queries sees (2048 + 1) / 2 positions on average
    flops = 2 * 2048 * M.layer_params() / 8 + 4 * 2048 * 1024.5 * 64 * 128 / 8
    head = 8192 * 128256 / 8 * 2 / 3.35e12  # only the last position's logits: reading the head's weights dominates
    assert one.compute_s == pytest.approx(80 * flops / 989e12 + head)


def test_measured_device_interpolates_and_extrapolates():
    per_tok = 1e6
    dev = measured("cpu", {1: 0.01, 3: 0.05}, per_tok)
    assert dev.time(per_tok, 0, 1) == pytest.approx(0.01)
    assert dev.time(2 * per_tok, 0, 2) == pytest.approx(0.03)  # halfway between 0.01 and 0.05
    assert dev.time(6 * per_tok, 0, 6) == pytest.approx(0.10)  # linear in tokens past the last point
    assert dev.time(4 * per_tok, 0, 2) == pytest.approx(0.06)  # extra (attention) FLOPs at the same rate


def test_crossing():
    slow_links = Links(allreduce_latency=1.0)
    hits, worst = crossing(M, H100, slow_links, 8, 1, "decode", max_tokens=64)
    assert hits == [1, 2, 4, 8, 16, 32, 64] and worst.comm_share > 0.9
    ideal = Links(nvlink_bw=math.inf, allreduce_latency=0.0, ib_bw=math.inf, ib_latency=0.0)
    hits, worst = crossing(M, roofline("x", 1e15, 1e12), ideal, 8, 2, "prefill", max_tokens=64)
    assert hits == [] and worst.comm_share == 0.0


def test_cli_prints_table():
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "scale-model", "--measure-tokens", "1,2",
                        "--decode-batches", "1", "--prefill-tokens", "512", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "| H100 SXM (datasheet roofline) | TP=8 | decode | 1 |" in r.stdout
    assert "| this CPU, 1 rank = measured | TP=8 PP=2 | prefill | 512 |" in r.stdout
    assert "GFLOP/s" in r.stdout
