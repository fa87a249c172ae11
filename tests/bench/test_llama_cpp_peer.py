"""The current llama.cpp as a peer (docs/benchmarks.md): K-quant GGUFs written by llama.cpp's own converter and
``llama-quantize`` run packed in pagedllm with greedy parity against the dequantized file; ``bench latency
--llama-bench`` alternates llama-bench with pagedllm on the same file; ``bench llama-cpp-perplexity`` scores the
same tokens both ways.

The tool tests need the peer build of ``ci/setup_llamacpp_peer.sh`` (``PAGEDLLM_LLAMA_CPP`` or
``~/.cache/pagedllm/llama.cpp-b11434``; ~8 min on 2 cores) and are skipped, saying so, where it is absent: CI
without the peer still passes. They use a tiny random Llama (hidden 256: K-quant super-blocks are 256 wide) with the
embedded SmolLM2 tokenizer, which llama.cpp's converter recognises. llama-perplexity gets ``--no-repack``: on a VM
with AMX, ggml's AMX path faults in batched runs (llama_cpp_bench's docstring; bench latency retries such a test with
``--repack 0`` by itself); elsewhere it is harmless.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.bench.llama_cpp_bench import cpu_kind, llama_bench_command, llama_cpp_bin, wait_with_peak_rss

QUANTIZE, BENCH, PERPLEXITY, CONVERT = (llama_cpp_bin(t) for t in ("llama-quantize", "llama-bench",
                                                                    "llama-perplexity", "convert_hf_to_gguf"))
needs_llama_cpp = pytest.mark.skipif(
    not all(os.access(t, os.X_OK) for t in (QUANTIZE, BENCH, PERPLEXITY, CONVERT)),
    reason=f"llama.cpp peer not built ({os.path.dirname(QUANTIZE)}): run ci/setup_llamacpp_peer.sh")
TYPES = ("Q4_K_M", "Q5_K_M", "Q8_0")


def _cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_llama_bench_command_and_cpu_kind():
    """One test per llama-bench call, one repeat, JSON out; the CPU named with the instruction sets that pick
    kernels (every figure must say which CPU it is from)."""
    assert llama_bench_command("/x/llama-bench", "m.gguf", 2, 0, 128) == [
        "/x/llama-bench", "-m", "m.gguf", "-p", "0", "-n", "128", "-t", "2", "-r", "1", "-o", "json"]
    assert llama_bench_command("/x/llama-bench", "m.gguf", 2, 2048, 0, depth=512)[3:9] == [
        "-p", "2048", "-n", "0", "-d", "512"]
    with open("/proc/cpuinfo") as f:
        name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    assert cpu_kind().startswith(name) and cpu_kind().endswith(f"{os.cpu_count()} CPUs")


def test_a_childs_peak_rss_is_its_own_not_its_parents():
    """The peer's peak RSS is the child's own address space: wait4's ru_maxrss for a subprocess child counted this
    (parent) process's 400 MB peak, which made llama-bench's column read pagedllm's own RSS when run beside it."""
    ballast = b"x" * (400 << 20)  # this process's peak, well above the child's
    child = subprocess.Popen([sys.executable, "-c", "b = b'y' * (64 << 20); import time; time.sleep(0.3)"])
    status, peak = wait_with_peak_rss(child.pid)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait again
    assert child.returncode == 0 and len(ballast) == 400 << 20
    assert (64 << 20) < peak < (64 << 20) + (60 << 20), peak  # the child's 64 MB and its interpreter, not 400 MB


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, str]:
    """A tiny random Llama (bf16 safetensors + the embedded SmolLM2 tokenizer) through llama.cpp's converter (BF16)
    and llama-quantize: type -> file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.paths import default_model_path

    root = tmp_path_factory.mktemp("llamacpp")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path()),
                                        gguf_file=os.path.basename(default_model_path()))
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, initializer_range=0.1, rms_norm_eps=1e-5,
                                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    bf16 = str(root / "tiny-BF16.gguf")
    subprocess.run([CONVERT, str(root / "hf"), "--outtype", "bf16", "--outfile", bf16], check=True,
                   capture_output=True, timeout=300)
    files = {}
    for t in TYPES:
        files[t] = str(root / f"tiny-{t}.gguf")
        subprocess.run([QUANTIZE, bf16, files[t], t, "2"], check=True, capture_output=True, timeout=300)
    return files


@needs_llama_cpp
@pytest.mark.slow
def test_llama_cpp_k_quants_run_packed_with_greedy_parity(tiny_ggufs, tmp_path):
    """Files from llama.cpp's own quantizer: every linear on a packed kernel (Q4_K_M mixes Q4_K and Q6_K, Q5_K_M
    Q5_K and Q6_K), greedy tokens equal to the same file dequantized to float32 by gguf.quants. On the fp32-activation
    kernels: these random weights have near-ties at the first tokens, which decode's int8 activations (opt-in,
    llama.cpp's arithmetic) may swap; that path's parity is measured on SmolLM2 (docs/benchmarks.md) and against its
    float64 emulation (tests/plugins/cpu/test_kquant_q8k.py)."""
    out = tmp_path / "parity.json"
    p = _cli("gguf-parity", "--tokens", "12", "--json", str(out), *tiny_ggufs.values(),
             env={"PAGEDLLM_CPU_INT8_ACT": "0"})
    res = {os.path.basename(r["path"]): r for r in json.loads(out.read_text())}
    kernels = {k for r in res.values() for k in r["kernels"]}
    assert {"Q4_K -> cpu-kquant-gemv", "Q5_K -> cpu-kquant-gemv", "Q6_K -> cpu-kquant-gemv",
            "Q8_0 -> cpu-q8-gemv"} <= kernels, kernels
    for name, r in res.items():
        assert r["ok"] and not r["fallbacks"] and len(r["packed"]) == 12, (name, r)
        assert r["packed"] == r["reference"]
    assert p.stdout.count("ok  ") == len(TYPES)


@needs_llama_cpp
@pytest.mark.slow
def test_bench_latency_alternates_llama_bench_on_the_same_file(tiny_ggufs, tmp_path):
    """llama-bench tg and pp beside pagedllm's decode and prefill, per iteration; ratios of the medians, llama.cpp's
    build, both peak RSS and the file's size, bytes read per token and the host time per step."""
    path, out = tiny_ggufs["Q4_K_M"], tmp_path / "lat.json"
    p = _cli("latency", "--model", path, "--device", "cpu", "--input-len", "16", "--output-len", "8", "--num-iters",
             "2", "--prefill-len", "64", "--llama-bench", BENCH, "--json", str(out))
    res = json.loads(out.read_text())
    lc, ours = res["llama_cpp"], res["engines"]["pagedllm"]
    assert lc["build"].startswith("b") and "Q4_K" in lc["model_type"] and lc["file_bytes"] == os.path.getsize(path)
    assert lc["tg_args"] in ([], ["--repack", "0"]) and lc["pp_args"] in ([], ["--repack", "0"])
    assert len(lc["tg_tok_s"]) == len(lc["pp_tok_s"]) == len(lc["ours_pp_tok_s"]) == 2
    assert all(r > 0 for r in lc["tg_tok_s"] + lc["pp_tok_s"] + lc["ours_pp_tok_s"])
    assert abs(lc["decode_ratio"] - ours["decode_tok_s"] / lc["median_tg_tok_s"]) < 1e-9
    assert abs(lc["prefill_ratio"] - lc["median_ours_pp_tok_s"] / lc["median_pp_tok_s"]) < 1e-9
    assert lc["peak_rss_bytes"] > 0 and res["peak_rss_bytes"] > 0 and res["file_bytes"] == lc["file_bytes"]
    assert res["bytes_per_token"] == res["weight_bytes"] + res["kv_bytes_per_token"] > res["weight_bytes"]
    assert res["host_us_per_step"] > 0 and res["threads"] >= 1
    assert "llama.cpp b" in p.stdout and "prefill pp64" in p.stdout
    assert "decode tg8 (pagedllm after a 16-token prompt)" in p.stdout


@needs_llama_cpp
@pytest.mark.slow
def test_perplexity_on_llama_cpps_tokens_matches_llama_perplexity(tiny_ggufs, tmp_path):
    """The same file, text and tokens, scored llama-perplexity's way (second half of each chunk): pagedllm's
    packed Q8_0 within 0.5% of llama.cpp's (the issue's quality goal)."""
    out = tmp_path / "ppl.json"
    _cli("llama-cpp-perplexity", "--llama-perplexity", PERPLEXITY, "--model", tiny_ggufs["Q8_0"], "--ctx", "128",
         "--chunks", "2", "--llama-args=--no-repack", "--json", str(out))
    res = json.loads(out.read_text())
    assert res["chunks"] == 2 and res["ctx"] == 128 and res["scored_tokens"] == 2 * 63
    assert res["quantization"] == "gguf" and res["llama_cpp"] > 1
    assert abs(res["ratio"] - 1) < 0.005, res


@needs_llama_cpp
@pytest.mark.slow
def test_perplexity_f32_peer_separates_llama_cpps_8bit_activations(tiny_ggufs, tmp_path):
    """``--f32-peer``: llama-perplexity on the file dequantized to F32 by llama-quantize, on the same tokens. pagedllm's
    packed K-quant kernels (float32 activations) equal the dequantized weights, so they sit on that figure (measured
    on SmolLM2: +0.01% / -0.00%), while llama.cpp's own quantized run carries its 8-bit activations' rounding."""
    out = tmp_path / "ppl.json"
    p = _cli("llama-cpp-perplexity", "--llama-perplexity", PERPLEXITY, "--model", tiny_ggufs["Q4_K_M"], "--ctx",
             "128", "--chunks", "2", "--llama-args=--no-repack", "--f32-peer", "--json", str(out))
    res = json.loads(out.read_text())
    assert res["llama_cpp_f32"] > 1 and abs(res["ratio_f32"] - 1) < 0.001, res
    assert "dequantized to F32" in p.stdout
