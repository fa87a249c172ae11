"""The compatibility promise (N loads N-1), on a backend written against contract v1 (before v2 existed) and shipped
as a vendor ships it: a package found through its entry point. It passes conformance on what it declares, its
undeclared features shown as not applicable; it has no host-cache allocator (v1 had none), so core gives it host
caches from its own allocator in its own layout and swaps through its own swap hook; a backend that cannot swap is
refused swap with a reason and preempts by recompute; with an off-by-one block offset injected, the end-to-end stage
fails at every block size on its top-k logprobs against core's reference backend."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backend.hookspec import API_VERSION
from pagedllm.backend.registry import Backend
from pagedllm.conformance.checks_e2e import hf_greedy, tiny_llama
from plugin_factory import make_plugin, v1_backend_source, write_plugin_package
from test_conformance_verdicts import BLOCKS_FIRST


@pytest.fixture(scope="module")
def v1_site(tmp_path_factory) -> str:
    """Two v1-era vendor packages: ``oldvendor`` and ``oldbug`` (the same with the block-offset bug)."""
    root = tmp_path_factory.mktemp("v1_site")
    write_plugin_package(root, "oldvendor-pagedllm", "oldvendor_pagedllm", v1_backend_source("oldvendor"), "oldvendor")
    write_plugin_package(root, "oldbug-pagedllm", "oldbug_pagedllm", v1_backend_source("oldbug", True), "oldbug")
    return str(root)


def conformance(site: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, *sys.path]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", "conformance", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_v1_backend_passes_on_what_it_declares(v1_site, tmp_path):
    res = conformance(v1_site, "--device", "oldvendor", "--report", str(tmp_path), "-q")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "**PASS**" in res.stdout
    report = json.loads((tmp_path / "conformance-oldvendor.json").read_text())
    rows = report["results"]
    assert report["counts"]["failing"] == report["counts"]["untested"] == 0
    by_kernel: dict = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    # never declared (v1 had no MLA, ALiBi, fp8 KV): not applicable with the reason, never run, never failed
    for kernel, why in (("mla_attention", "capabilities do not declare mla"),
                        ("paged_attention.alibi", "capabilities do not declare alibi"),
                        ("write_kv.fp8_e4m3", "capabilities do not declare kv_cache_dtype fp8_e4m3"),
                        ("quantized_linear.gguf", "capabilities do not declare quantization gguf"),
                        ("dtype.float16", "capabilities do not declare dtype float16")):
        assert by_kernel[kernel] and all(r["not_applicable"] and r["error"] == why and r["seconds"] == 0
                                         for r in by_kernel[kernel]), by_kernel[kernel]
    assert report["counts"]["not_applicable"] == sum(r["not_applicable"] for r in rows) > 0
    assert "not applicable (the backend does not declare them: never run)" in res.stdout
    # no v1 host allocator: core's fallback is its own allocator on the host, its own swap copies between them
    (own,) = by_kernel["layout_ownership"]
    assert own["status"] == "passing" and "the backend's own allocator on the host" in own["detail"]
    swaps = by_kernel["swap_kv_blocks"]
    assert len(swaps) == 4 and all(r["status"] == "passing" and not r["fallback"] for r in swaps)
    assert all("host caches from core's fallback: the backend's own allocator on the host" in r["detail"]
               for r in swaps)
    # its own kernels are verified; core's reference ops that served it are counted apart
    assert all(r["status"] == "passing" and not r["fallback"] for r in by_kernel["paged_attention.decode"])
    assert all(r["fallback"] for r in by_kernel["rms_norm"] + by_kernel["rotary"] + by_kernel["fused_moe"])
    assert report["features"]["attention"] == report["features"]["kv_cache"] == "verified-on-hardware"
    assert report["features"]["fused_ops"] == "reference-fallback"
    assert report["counts"]["reference_fallback"] == sum(r["fallback"] for r in rows) > 0
    e2e = by_kernel["greedy_parity_vs_hf"]
    assert {r["model"] for r in e2e} == {"tiny-llama-hs64-bs32", "tiny-llama-hs64-bs16"}
    assert all(r["status"] == "passing" and "logprobs within 0.001 of core's reference backend" in r["detail"]
               for r in e2e)
    assert report["verification"] == "verified-on-hardware" and report["evidence"].startswith("host CPU")


def test_injected_block_offset_bug_fails_end_to_end_at_every_block_size(v1_site, tmp_path):
    res = conformance(v1_site, "--device", "oldbug", "--allow", "e2e", "--report", str(tmp_path), "-q")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "**FAIL**" in res.stdout
    rows = [r for r in json.loads((tmp_path / "conformance-oldbug.json").read_text())["results"]
            if r["feature"] == "e2e"]
    assert len(rows) == 2 and all(r["status"] == "failing" for r in rows)
    for r in rows:
        bs = int(r["model"].rsplit("bs", 1)[1])
        assert "against core's reference backend" in r["error"] and "tolerance 0.001" in r["error"], r["error"]
        # located at the first position the bug touches: the last slot of block 0
        assert f"computed at position {bs - 1}, block 0 offset {bs - 1}" in r["error"], r["error"]


def _load(site: str, module: str):
    sys.path.insert(0, site)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(site)


def _preempting_run(backend: Backend, path: str, prompts: list, bs: int):
    from pagedllm import LLM, SamplingParams
    from pagedllm.conformance.checks_e2e import MAX_TOKENS, selected_by_name

    with selected_by_name(backend):
        llm = LLM(model=path, device=backend.name, dtype="float32", block_size=bs, skip_tokenizer_init=True,
                  max_model_len=4 * bs, max_num_seqs=4, num_gpu_blocks_override=7, swap_space=0.01)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return llm.llm_engine, [list(o.outputs[0].token_ids) for o in outs]


def test_engine_swaps_a_v1_backend_through_its_own_host_layout_or_recomputes(v1_site, caplog):
    """A pool of 7 blocks for prompts of 2-3 blocks forces preemption: the v1 backend swaps through host caches of
    its own blocks-first layout; a backend with its own layout and no swap hook is refused swap (a warning with the
    reason) and recomputes. Both generate exactly HF's greedy tokens."""
    bs = 16
    path = tiny_llama(64, max_positions=8 * bs)
    gen = torch.Generator().manual_seed(3)
    lens = (2 * bs + 12, 2 * bs + 13, 2 * bs + 14)  # 3 blocks each, a 4th while decoding: 2 fit, then preemption
    prompts = [[int(t) + 3 for t in torch.randint(120, (n,), generator=gen)] for n in lens]
    want = hf_greedy(path, prompts)

    v1 = Backend(_load(v1_site, "oldvendor_pagedllm"), "oldvendor")
    assert v1.info.api_version == API_VERSION - 1 and not v1.implements("pagedllm_allocate_host_kv_cache")
    engine, got = _preempting_run(v1, path, prompts, bs)
    host = engine.worker.host_caches
    assert host is not None and tuple(host[0].shape)[1:] == (2, bs, 2, 64)  # blocks-first, on the host
    assert host[0].device.type == "cpu" and engine.scheduler.num_swaps > 0
    assert got == want

    no_swap = Backend(make_plugin("own-no-swap", **BLOCKS_FIRST), "own-no-swap")
    with caplog.at_level(logging.WARNING):
        engine, got = _preempting_run(no_swap, path, prompts, bs)
    assert engine.worker.host_caches is None and engine.scheduler.num_swaps == 0
    assert engine.scheduler.num_preemptions > 0 and got == want
    assert "swap not supported by backend 'own-no-swap'; preemption uses recompute" in caplog.text
