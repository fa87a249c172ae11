"""``pagedllm bench latency``: per-token timestamps for pagedllm and HF on the same prompts, and the bandwidth floor."""

from __future__ import annotations

import json
import subprocess
import sys

from pagedllm.bench.latency import summarize


def test_summarize_medians_and_percentiles():
    lat = summarize([[0.5, 0.6, 0.7, 0.8], [0.3, 0.5, 0.7, 0.9]])
    assert lat.ttft_s == 0.4  # median of 0.5 and 0.3
    assert abs(lat.decode_tok_s - (3 / 0.3 + 3 / 0.6) / 2) < 1e-9
    assert abs(lat.itl_p50_ms - 150.0) < 1e-6 and abs(lat.itl_p99_ms - 200.0) < 1e-6


def test_bench_latency_ours_and_hf(tiny_llama, tmp_path):
    out = tmp_path / "lat.json"
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "latency", "--model", tiny_llama, "--device",
                        "cpu", "--dtype", "float32", "--input-len", "40", "--output-len", "6", "--num-iters", "2",
                        "--compare-hf", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["engines"]) == {"pagedllm", "hf"}
    for lat in res["engines"].values():
        assert len(lat["ttfts"]) == 2 and all(t > 0 for t in lat["ttfts"])
        assert lat["decode_tok_s"] > 0 and 0 < lat["itl_p50_ms"] <= lat["itl_p99_ms"]
    assert res["weight_bytes"] > 0 and res["copy_bandwidth_gb_s"] > 0
    assert abs(res["floor_tok_s"] - res["copy_bandwidth_gb_s"] * 1e9 / res["weight_bytes"]) < 1e-6 * res["floor_tok_s"]
    assert "memory-bandwidth floor" in p.stdout


def test_weight_bytes_per_token_counts_every_linear_and_the_head(tiny_llama):
    """The bytes a decode step streams equal the HF checkpoint's projection and LM-head tensors (whatever layout
    the backend's kernels packed them into), and the GEMM ceiling is a positive time."""
    from safetensors.torch import load_file

    from pagedllm.bench.ceiling import gemm_step_seconds, weight_bytes_per_token
    from pagedllm.entrypoints.llm import LLM

    sd = load_file(f"{tiny_llama}/model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"
    want = sum(t.numel() * 4 for n, t in sd.items() if "_proj." in n or n == head)
    model = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64,
                kv_cache_memory=4 << 20).llm_engine.model
    assert weight_bytes_per_token(model) == want
    assert gemm_step_seconds(model, 4, repeats=2) > 0


def test_weight_bytes_per_token_of_a_packed_gguf_equal_the_files_tensors():
    """The embedded SmolLM2 Q4_1 file runs on packed kernels whose state is a record (the Q4 blocks), not a bare
    tensor: a step still reads every projection's blocks and the Q8_0 tied head, byte for byte as in the file (the
    Q4 blocks are repacked 16 rows at a time; 576 x 576 and up are whole groups)."""
    import re

    from gguf import GGUFReader

    from pagedllm.bench.ceiling import weight_bytes_per_token
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.models.paths import default_model_path

    linear = re.compile(r"\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
    want = sum(int(t.n_bytes) for t in GGUFReader(default_model_path()).tensors
               if linear.search(t.name) or t.name == "token_embd.weight")
    model = LLM(device="cpu", max_model_len=64, kv_cache_memory=4 << 20).llm_engine.model
    assert weight_bytes_per_token(model) == want


def test_gemm_workload_floor_counts_prefill_chunks_and_decode_steps(monkeypatch):
    """The throughput workload's GEMM floor: prompts in chunks of the token budget (LM head on the prompts each
    chunk completes), then output_len - 1 decode steps at the full batch."""
    from pagedllm.bench import ceiling

    calls = []
    monkeypatch.setattr(ceiling, "gemm_step_seconds",
                        lambda model, batch, repeats=7, head_rows=None: calls.append((batch, head_rows)) or 1.0)
    assert ceiling.gemm_workload_seconds(None, 64, 32, 64, 2048) == (1.0, 63.0)
    assert calls == [(2048, 64), (64, None)]
    calls.clear()
    assert ceiling.gemm_workload_seconds(None, 10, 32, 5, 100) == (4.0, 4.0)  # 3 + 3 + 3 + 1 prompts per chunk
    assert calls == [(96, 3), (96, 3), (96, 3), (32, 1), (10, None)]


def test_the_vllm_peer_gets_pagedllms_kv_pool_rounded_up_to_whole_gib(tiny_llama):
    """`--compare-vllm` gives vLLM (VLLM_CPU_KVCACHE_SPACE, whole GiB) at least pagedllm's KV pool: with a fixed
    2 GiB (10.9k tokens of the 1.7B model) against pagedllm's 4 GiB, vLLM could not hold 64 x 256 tokens at once."""
    from pagedllm.bench.peer import kv_pool_gib
    from pagedllm.entrypoints.llm import LLM

    engine = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=8 << 20).llm_engine
    pool = engine.worker.num_blocks * engine.worker.bytes_per_block()
    gib = kv_pool_gib(engine)
    assert 0 < pool <= gib << 30 and (gib == 1 or (gib - 1) << 30 < pool)
