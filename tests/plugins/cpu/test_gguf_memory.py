"""Memory of a GGUF model on the CPU backend (issue 32): a tied Q8_0 / Q4_K embedding stays the file's blocks (no
dense fp32 table; its LM head reads the same blocks, or on CPUs with AVX-512 VNNI a Q4_K head its repacked copy with
the file's pages dropped), no weight is held twice, block types the kernels read in place are the file's pages rather
than a copy, repacked ones leave no file page resident; and the streaming-read probe's checksum is numpy's."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm.models.gguf_weights import read_tensors
from pagedllm.models.quantized_embedding import QuantizedEmbedding
from pagedllm.quantization.gguf import random_blocks

VOCAB, HIDDEN = 768, 256


def _tied_gguf(out_dir, qtype: str) -> str:
    """A 2-layer tiny Llama with a tied embedding, every 2-D tensor (the embedding too) in ``qtype``."""
    import gguf
    from gguf_utils import TINY_GGUF_LLAMA, add_model_header, finish
    from tiny_models import make_tiny_model
    from transformers import AutoConfig

    hf_dir = make_tiny_model("llama", os.path.join(out_dir, "hf"), **{**TINY_GGUF_LLAMA, "vocab_size": VOCAB},
                             tie_word_embeddings=True)
    c = AutoConfig.from_pretrained(hf_dir)
    path = os.path.join(out_dir, f"tied-{qtype}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    add_model_header(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    rng = np.random.default_rng(0)
    from safetensors.torch import load_file

    for hf_name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if t.ndim == 2:  # random valid blocks: the rows' values need no q/k permute to be a valid model
            w.add_tensor(name, random_blocks(qtype, *t.shape, rng), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, t.float().numpy())
    return finish(w, path)


def _storages(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor the model holds, by storage: parameters, buffers and the kernels' states (LM head included),
    but not the KV caches or rotary tables (not weights)."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}

    def visit(name, obj, depth=0):
        if isinstance(obj, torch.Tensor):
            seen.setdefault(obj.untyped_storage().data_ptr(), (name, obj))
        elif isinstance(obj, (list, tuple)) and depth < 4:
            for i, o in enumerate(obj):
                visit(f"{name}[{i}]", o, depth + 1)

    for mod_name, mod in model.named_modules():
        for key, value in vars(mod).items():
            if key in ("_parameters", "_buffers"):
                for k, v in value.items():
                    if v is not None and k not in ("cos_sin_cache", "rope_caches"):
                        visit(f"{mod_name}.{k}", v)
            elif key not in ("kv_caches", "cos_sin_cache", "rope_caches", "_modules"):
                visit(f"{mod_name}.{key}", value)
    return seen


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_tied_block_embedding_has_no_dense_copy_and_no_weight_is_held_twice(lib, tmp_path, qtype):
    from pagedllm import LLM, SamplingParams

    path = _tied_gguf(tmp_path, qtype)
    _, tensors = read_tensors(path)
    file_tensor_bytes = sum(t.data.nbytes for t in tensors)
    embd = next(t for t in tensors if t.name == "token_embd.weight")
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, quantization="gguf", max_model_len=64,
              kv_cache_memory=4 << 20)
    model = llm.llm_engine.model
    emb = model.embed_tokens
    assert isinstance(emb, QuantizedEmbedding) and emb.weight_type.name == qtype
    assert emb.blocks.shape == embd.data.shape and emb.blocks.nbytes == embd.data.nbytes  # packed: the file's bytes
    assert not emb.blocks.flags.writeable  # the file's read-only mapping, not a copy
    assert not list(emb.parameters()) and not list(emb.buffers())
    held = _storages(model)
    for name, t in held.values():  # no dense table of the vocabulary anywhere (embedding or LM head)
        assert not (t.is_floating_point() and t.shape and t.shape[0] == VOCAB), (name, t.shape, t.dtype)
    head = model.lm_head_kernel[1]
    head_blocks = head if isinstance(head, torch.Tensor) else head[0]
    nbytes = {ptr: t.untyped_storage().nbytes() for ptr, (_, t) in held.items()}
    repacked = isinstance(head, tuple) and head[5]  # kquant_r16's 16-row layout: Q4_K's 148 bytes a row for 144
    if repacked:  # the head is its own copy; the file's pages (the embedding's too) are not resident
        assert head_blocks.numel() == emb.blocks.nbytes * 148 // 144
        assert _mapped_rss(path) <= 64 << 10
    else:
        assert head_blocks.data_ptr() == emb.blocks.ctypes.data  # the LM head reads the embedding's own blocks
        nbytes.setdefault(emb.blocks.ctypes.data, emb.blocks.nbytes)  # (the head's state when it reads them)
    bound = file_tensor_bytes * 148 // 144 if repacked else file_tensor_bytes
    assert sum(nbytes.values()) <= bound, (held, file_tensor_bytes)  # no second copy of any weight

    ids = torch.tensor([[3, 0, VOCAB - 1, 77]])  # a lookup dequantizes exactly the file's rows
    from gguf.quants import dequantize
    want = torch.from_numpy(np.asarray(dequantize(embd.data[ids[0].numpy()], embd.tensor_type), dtype=np.float32))
    torch.testing.assert_close(emb(ids)[0], want, rtol=0, atol=0)
    out = llm.generate({"prompt_token_ids": [1, 5, 9]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    if repacked:  # lookups map back only pages of the embedding (each fault maps its 64 KiB window around it)
        assert _mapped_rss(path) <= emb.blocks.nbytes + (256 << 10) < os.path.getsize(path)


def _mapped_rss(path: str) -> int:
    """Bytes of ``path`` resident in this process's mappings of it (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's header line
                current = len(parts) >= 6 and os.path.realpath(parts[5]) == os.path.realpath(path)
            elif current and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def _file_backed(t: torch.Tensor, path: str) -> bool:
    """Whether ``t``'s bytes lie in a mapping of ``path`` (/proc/self/maps)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return len(parts) >= 6 and os.path.realpath(parts[5]) == os.path.realpath(path)
    return False


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_in_place_block_linears_read_the_files_pages(lib, tmp_path, qtype):
    """Linears of a type the kernel reads in place (unfused, rows in file order: ``o_proj``, ``down_proj``) keep the
    file's mapping as their weight, as llama.cpp's mmap does: no anonymous copy, pages the kernel can drop. Where the
    kernel repacks them (Q4_K on a CPU with AVX-512 VNNI) the copy is all there is: no page of the file stays
    resident."""
    from pagedllm import LLM

    path = _tied_gguf(tmp_path, qtype)
    model = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, quantization="gguf", max_model_len=64,
                kv_cache_memory=4 << 20).llm_engine.model
    repacked = qtype == "Q4_K" and bool(lib.kquant_r16_available())
    for layer in model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            blocks = linear.state if isinstance(linear.state, torch.Tensor) else linear.state[0]
            assert _file_backed(blocks, path) != repacked, (qtype, linear)
    if repacked:
        assert _mapped_rss(path) <= 64 << 10


@pytest.mark.parametrize("nbytes", [64, 64 * 4097, 3 << 20])
def test_stream_read_checksum_is_the_xor_of_every_word(lib, nbytes):
    rng = np.random.default_rng(nbytes)
    buf = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    want = int(np.bitwise_xor.reduce(buf.numpy().view(np.uint64)).astype(np.int64))
    for isa in range(lib.stream_read_best_isa() + 1):  # every level the CPU runs: portable, AVX2, AVX-512
        assert lib.stream_read(buf, isa) == want, isa
    assert lib.stream_read(buf) == want


def test_stream_read_refuses_a_partial_line(lib):
    with pytest.raises(RuntimeError, match="64-byte lines"):
        lib.stream_read(torch.zeros(65, dtype=torch.uint8))


def test_bench_finds_the_stream_read_op_through_the_registry(lib):
    from pagedllm.bench.latency import stream_read_bandwidth, stream_read_op

    op = stream_read_op("cpu")
    assert op is not None and stream_read_op("no-such-backend") is None
    assert stream_read_bandwidth(op, nbytes=8 << 20, repeats=2) > 0  # the checksum is checked inside


def test_matmul_peak_runs_bf16_dot_products_where_the_cpu_has_them(lib):
    """The bf16 peak probe: positive where /proc/cpuinfo lists AMX-BF16 (tile dot products) or AVX512-BF16 (vector
    ones), 0 where neither; never above what the instructions can do (a loop the compiler folded reports more); the
    bench finds it through the registry and states nothing for a backend without it."""
    from pagedllm.bench.ceiling import matmul_peak_tflops

    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split()) for line in f if line.startswith("flags")), set())
    amx, vector = {"amx_tile", "amx_bf16"} <= flags, {"avx512f", "avx512_bf16"} <= flags
    peak = lib.matmul_peak(0.05)
    assert (peak > 0) if (amx or vector) else peak == 0
    if vector and not amx:  # two 16-lane vdpbf16ps (64 FLOP each) a cycle a core at 5 GHz, on torch's threads
        assert peak <= 2 * 64 * 5e9 * torch.get_num_threads() / 1e12
    assert (matmul_peak_tflops("cpu", 0.05) is not None) == (amx or vector)
    assert matmul_peak_tflops("no-such-backend") is None


def test_linear_flops_are_the_configs_matrix_shapes(tiny_llama):
    """FLOPs of a step's (and the throughput workload's) linears and LM head, against the arithmetic of the HF config
    (q, k, v, o, gate, up, down per layer; hidden x vocab once a row that reaches the head)."""
    from pagedllm import LLM
    from pagedllm.bench.ceiling import decode_kv_read_bytes, linear_flops, workload_flops
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_llama)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i = c.hidden_size, c.intermediate_size
    layer = h * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * h * i
    llm = LLM(tiny_llama, device="cpu", dtype="bfloat16", max_model_len=64, kv_cache_memory=1 << 20)
    assert linear_flops(llm.llm_engine.model, 8) == 2 * 8 * (c.num_hidden_layers * layer + h * c.vocab_size)
    # 4 prompts x 10 -> 3: 4 x 12 rows through the layers, 4 x 3 through the LM head
    assert workload_flops(llm.llm_engine.model, 4, 10, 3) == 2 * (48 * c.num_hidden_layers * layer
                                                                  + 12 * h * c.vocab_size)
    # the decode steps' KV reads: the pool's bytes a position are every layer's bf16 keys and values; 4 x 10 -> 3
    # decodes twice a prompt, over 11 then 12 positions
    spec = llm.llm_engine.worker.kv_spec
    per_position = c.num_hidden_layers * c.num_key_value_heads * hd * 2 * 2
    assert spec.bytes_per_block / spec.block_size == per_position
    assert decode_kv_read_bytes(per_position, 4, 10, 3) == 4 * (11 + 12) * per_position



def test_bench_throughput_states_the_gemm_and_kv_floors(tiny_llama, tmp_path, lib):
    """``bench throughput --gemm-ceiling`` on a bf16 model: the workload's GEMMs alone, the KV cache its decode steps
    read against the streaming-read rate (the CPU's op), and, where the CPU has bf16 dot products, its bf16 peak."""
    import json
    import subprocess
    import sys

    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "throughput", "--model", tiny_llama,
                        "--device", "cpu", "--dtype", "bfloat16", "--num-prompts", "4", "--input-len", "16",
                        "--output-len", "4", "--repeats", "1", "--gemm-ceiling", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert sum(res["gemm_workload_s"]) > 0 and res["stream_read_gb_s"] > 0
    assert res["decode_kv_read_gb"] > 0
    assert "decode attention reads" in p.stdout and "of KV cache" in p.stdout
    assert ("at that peak" in p.stdout) == (res["matmul_peak_tflops"] is not None)

@pytest.mark.slow
def test_bench_latency_reports_the_stream_floor_and_sizes_the_engine(lib, tiny_llama, tmp_path):
    """``bench latency`` on the CPU backend: the streaming-read floor beside the copy one, "floor reached", the
    engine sized for the run (no KV size given: the longest request, one sequence), the peak split at load, and the
    peak's floor (what was resident before loading plus the weights every token reads)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "lat.json"
    p = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "latency", "--model", tiny_llama, "--device",
                        "cpu", "--dtype", "float32", "--input-len", "20", "--output-len", "6", "--num-iters", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["stream_read_gb_s"] > 0
    assert res["stream_floor_tok_s"] == pytest.approx(res["stream_read_gb_s"] * 1e9 / res["weight_bytes"])
    decode = res["engines"]["pagedllm"]["decode_tok_s"]
    assert res["floor_reached_pct"] == pytest.approx(100 * decode / res["stream_floor_tok_s"])
    assert (res["max_model_len"], res["max_num_seqs"]) == (26, 1)
    assert 0 < res["base_rss_bytes"] < res["peak_rss_bytes"]
    assert res["rss_floor_bytes"] == res["base_rss_bytes"] + res["weight_bytes"] <= res["peak_rss_bytes"]
    assert "streaming-read floor" in p.stdout and "floor reached" in p.stdout and "peak RSS floor" in p.stdout
