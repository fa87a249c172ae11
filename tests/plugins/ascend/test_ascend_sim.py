"""The ascend plugin on a SIMULATED torch-npu (tests/support/sim/torch_npu: an ``npu`` device through torch's
pure-Python PrivateUse1 route, and the vendor ops the plugin calls with core's reference semantics). Each test runs in a
subprocess with tests/support/sim on PYTHONPATH and a stand-in CANN folder (the probe looks for one before importing
torch_npu), because the device name can be set once per process. This proves the glue — layouts, metadata, dispatch
between the decode and the prefill kernel, device placement, memory hooks, the engine around it — not the vendor's
kernels: nothing here ran on an NPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SIM = str(Path(__file__).resolve().parents[2] / "support" / "sim")
PROMPTS = [[5, 17, 33, 9, 100], list(range(3, 3 + 130)), [7] * 40 + [11, 12]]  # 130 tokens: crosses a 128-block
MAX_TOKENS = 12


def run_on_sim(code: str, tmp_path: Path, timeout: int = 600) -> str:
    cann = tmp_path / "cann"  # the probe requires a CANN folder before it imports torch_npu
    cann.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=SIM + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASCEND_HOME_PATH=str(cann), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    prologue = ("import torch_npu\nassert torch_npu.__pagedllm_simulation__, 'not the simulated torch_npu'\n")
    res = subprocess.run([sys.executable, "-c", prologue + code], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res.stdout


# ---- conformance ----------------------------------------------------------------------------------------------------
CONFORMANCE = """
import json, sys
from pagedllm.conformance.runner import run_conformance
report = run_conformance("ascend", report_dir=REPORT_DIR)
print("RESULT", json.dumps([[r.kernel, r.model, r.dtype, r.status, r.error] for r in report.results]))
"""


@pytest.mark.slow
def test_conformance_kernel_and_runtime_checks_pass_on_the_simulated_npu(tmp_path):
    out = run_on_sim(CONFORMANCE.replace("REPORT_DIR", repr(str(tmp_path / "report"))), tmp_path)
    rows = json.loads(out.split("RESULT ", 1)[1])
    failing = [r for r in rows if r[3] not in ("passing", "untested", "partial")]
    assert not failing, failing
    passed = {(r[0], r[2]) for r in rows if r[3] == "passing"}
    for dtype in ("bfloat16", "float16"):
        for kernel in ("allocate_kv_cache", "write_kv", "gather_kv_blocks",
                       "paged_attention.decode", "paged_attention.prefill", "paged_attention.mixed",
                       "paged_attention.sliding_window", "rms_norm", "rotary", "silu_and_mul"):
            assert (kernel, dtype) in passed, (kernel, dtype, [r for r in rows if r[0] == kernel])
    assert ("memory_info", "-") in passed
    assert (tmp_path / "report" / "conformance-ascend.md").exists()


# ---- glue on the simulated device -----------------------------------------------------------------------------------
GLUE = r"""
import torch, torch_npu
from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import get_backend
from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm_ascend import attention

be = get_backend("ascend")
dev = be.device()
assert be.probe.usable and "simulated" in be.probe.device_name, be.probe
assert dev.type == "npu", dev
be.set_device(dev); be.synchronize(dev)

# layout: a (K, V) pair per layer, [num_blocks, block_size, Hkv, D] each, on the npu
free0 = be.memory_info(dev).free_bytes
be.memory_peak(dev)
spec = KVCacheSpec(2, 6, 128, 2, 64, torch.float16, dev)
caches = be.allocate_kv_cache(spec)
assert len(caches) == 2 and all(isinstance(c, tuple) and len(c) == 2 for c in caches)
assert all(t.shape == (6, 128, 2, 64) and t.device.type == "npu" and t.dtype == torch.float16
           for c in caches for t in c)
mi = be.memory_info(dev)
# torch's Python PrivateUse1 hooks cannot page-lock memory: the plugin asks torch and reports it
assert not mi.pinned_host and free0 - mi.free_bytes == 6 * spec.bytes_per_block, (free0, mi)
assert be.memory_peak(dev) >= 6 * spec.bytes_per_block
print("OK layout+memory")

# metadata: host values torch-npu's kernels take, built once per step
meta = AttentionMetadata.build([1, 1, 5, 130], [9, 200, 133, 130], [[0, 1], [2, 3], [4, 5], [1, 3]], 128, device=dev)
am = attention.ascend_metadata(meta)
assert am is attention.ascend_metadata(meta) and meta.extra["ascend"] is am
assert am.actual_seq_lengths_q == [1, 2, 7, 137] and am.actual_seq_lengths_kv == [9, 200, 133, 130]
assert am.context_lens.device.type == "cpu" and am.context_lens.dtype == torch.int32
assert not am.decode_only and am.num_tokens == 137
dec = AttentionMetadata.build([1, 1], [9, 200], [[0], [2, 3]], 128, device=dev)
assert attention.ascend_metadata(dec).decode_only
print("OK metadata")

# dispatch: decode-only -> _npu_paged_attention, everything else -> npu_fused_infer_attention_score
calls = []
for name in ("_npu_paged_attention", "npu_fused_infer_attention_score", "_npu_reshape_and_cache", "npu_rms_norm",
             "npu_swiglu"):
    fn = getattr(torch_npu, name)
    setattr(torch_npu, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
k_cache, v_cache = caches[0]
gen = torch.Generator().manual_seed(0)
def rnd(*shape): return torch.randn(*shape, generator=gen).to(device=dev, dtype=torch.float16)
slots = torch.arange(6 * 128, device=dev)
be.write_kv(rnd(768, 2, 64), rnd(768, 2, 64), caches[0], slots)
ref = torch.stack([k_cache, v_cache]).cpu()
for m, want in ((dec, "_npu_paged_attention"), (meta, "npu_fused_infer_attention_score")):
    calls.clear()
    q = rnd(m.num_tokens, 8, 64)
    out = be.paged_attention(q, caches[0], m, 0.125, None, None)
    expect = ref_ops.paged_attention(q.cpu(), ref, AttentionMetadata.build(
        [b - a for a, b in zip(m.query_start_loc_cpu, m.query_start_loc_cpu[1:])], m.seq_lens_cpu,
        m.block_tables.cpu().tolist(), 128), 0.125)
    assert calls == [want], calls
    assert out.device.type == "npu" and torch.allclose(out.cpu().float(), expect.float(), atol=4e-3, rtol=4e-3)
calls.clear()
be.paged_attention(rnd(2, 8, 64), caches[0], AttentionMetadata.build([1, 1], [9, 200], [[0], [2, 3]], 128,
                   device=dev), 0.125, 64, None)
assert calls == ["npu_fused_infer_attention_score"], calls  # sliding window: FIA's band mode, decode included
calls.clear()
x, w = rnd(3, 128), rnd(128)
assert torch.allclose(be.rms_norm(x, w, 1e-6).cpu().float(), ref_ops.rms_norm(x.cpu(), w.cpu(), 1e-6).float(),
                      atol=4e-3, rtol=4e-3)
assert torch.equal(be.silu_and_mul(x).cpu(), ref_ops.silu_and_mul(x.cpu()))
assert calls == ["npu_rms_norm", "npu_swiglu"], calls
print("OK dispatch")

# write_kv drops padding slots (-1) itself: the simulated kernel refuses negative slots, like any undocumented input
before = torch.stack([k_cache, v_cache]).cpu()
key, value = rnd(3, 2, 64), rnd(3, 2, 64)
be.write_kv(key, value, caches[0], torch.tensor([5, -1, 7], device=dev))
after = torch.stack([k_cache, v_cache]).cpu()
changed = (after != before).view(2, 6 * 128, -1).any(-1).any(0)
assert changed.nonzero().flatten().tolist() == [5, 7], changed.nonzero()
assert torch.equal(after[0].view(-1, 2, 64)[7], key.cpu()[2])
assert torch.equal(after[1].view(-1, 2, 64)[5], value.cpu()[0])
try:
    torch_npu._npu_reshape_and_cache(key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                                     slot_indices=torch.tensor([5, -1, 7], dtype=torch.int32, device=dev))
    raise AssertionError("the simulated kernel accepted a negative slot")
except RuntimeError as e:
    assert "slot indices" in str(e)
print("OK padding")

# swap in place on both tensors of each pair; device -> host -> device round trip
want = [torch.stack(c).cpu() for c in caches]
host = be.allocate_host_kv_cache(KVCacheSpec(2, 3, 128, 2, 64, torch.float16, torch.device("cpu")), False)
assert all(t.device.type == "cpu" and t.shape == (3, 128, 2, 64) for p in host for t in p)
be.swap_kv_blocks(caches, host, torch.tensor([1, 5], device=dev), torch.tensor([2, 0]))
for c in caches:
    for t in c:
        t.fill_(float("nan"))
be.swap_kv_blocks(host, caches, torch.tensor([2, 0]), torch.tensor([3, 1], device=dev))
for c, w in zip(caches, want):
    got = torch.stack(c).cpu()
    assert torch.equal(got[:, 3], w[:, 1]) and torch.equal(got[:, 1], w[:, 5]) and got[:, 0].isnan().all()
gathered = be.gather_kv_blocks(caches[1], torch.tensor([3, 1], device=dev))
assert gathered.shape == (2, 2, 128, 2, 64) and torch.equal(gathered.cpu(), want[1][:, [1, 5]])
print("OK swap")

# pinned host caches: the plugin asks torch to pin each tensor of each pair; torch's Python PrivateUse1 hooks cannot
# provide a pinned allocator, so on the simulation that request is refused by torch itself (not by the plugin)
try:
    be.allocate_host_kv_cache(KVCacheSpec(1, 1, 128, 2, 64, torch.float16, torch.device("cpu")), True)
    raise AssertionError("pinning unexpectedly worked on the simulated device")
except NotImplementedError as e:
    assert "getPinnedMemoryAllocator" in str(e)
print("OK pin request")

# device placement: the simulated device refuses mixed-device ops, as a real one does
try:
    k_cache[0] + torch.ones(128, 2, 64, dtype=torch.float16)
    raise AssertionError("mixed devices accepted")
except RuntimeError as e:
    assert "same device" in str(e)
print("OK placement")
"""


def test_glue_on_the_simulated_npu(tmp_path):
    out = run_on_sim(GLUE, tmp_path)
    assert [line for line in out.splitlines() if line.startswith("OK")] == [
        "OK layout+memory", "OK metadata", "OK dispatch", "OK padding", "OK swap", "OK pin request",
        "OK placement"], out


# ---- the engine on the simulated device vs HF transformers ----------------------------------------------------------
ENGINE = """
import json
from pagedllm import LLM, SamplingParams
out = {}
for dtype in ("auto", "float16"):
    llm = LLM(model=MODEL, device="ascend", dtype=dtype, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4,
              num_gpu_blocks_override=16)
    cfg = llm.llm_engine.config
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX),
                       use_tqdm=False)
    out[cfg.dtype] = dict(block_size=cfg.block_size, tokens=[list(o.outputs[0].token_ids) for o in res])
    del llm
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_engine_greedy_on_the_simulated_npu_equals_hf(tiny_llama, tmp_path):
    """Prefill through npu_fused_infer_attention_score, decode through _npu_paged_attention, a prompt crossing a
    128-token block; ``dtype=auto`` on a float32 checkpoint runs bfloat16. Oracle: HF transformers in the same
    dtype on the CPU, token for token."""
    from transformers import AutoModelForCausalLM

    code = (ENGINE.replace("MODEL", repr(tiny_llama)).replace("PROMPTS", repr(PROMPTS))
            .replace("MAX)", f"{MAX_TOKENS})"))
    got = json.loads(run_on_sim(code, tmp_path).split("RESULT ", 1)[1])
    assert set(got) == {"bfloat16", "float16"} and all(v["block_size"] == 128 for v in got.values()), got
    for dtype, res in got.items():
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        assert res["tokens"] == want, (dtype, res["tokens"], want)


GRAPHS = """
import json
from pagedllm import LLM, SamplingParams
from pagedllm.backend.graph_runner import DecodeGraphRunner
from pagedllm_ascend import graph
out = {}
for update in (True, False):
    if not update:  # what a replay gives without vllm-ascend's per-replay update of the host context lengths
        graph.AscendDecodeGraphRunner._load = DecodeGraphRunner._load
    llm = LLM(model=MODEL, device="ascend", dtype="float16", skip_tokenizer_init=True, max_model_len=256,
              max_num_seqs=4, num_gpu_blocks_override=16)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX),
                       use_tqdm=False)
    stats = llm.llm_engine.worker.graph_stats
    out[str(update)] = dict(level=llm.llm_engine.worker.graph_level, captured=stats["captured"],
                            replays=stats["replays"], tokens=[list(o.outputs[0].token_ids) for o in res])
    del llm
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_acl_graph_decode_on_the_simulated_npu_equals_hf(tiny_llama, tmp_path, monkeypatch):
    """Opt-in ACL graphs (PAGEDLLM_ASCEND_ACL_GRAPH=1): decode steps replay NPUGraphs captured per batch bucket
    (3 sequences run in the bucket of 4: padding rows), with _npu_paged_attention's host context lengths updated
    before each replay. The simulated graph replays recorded ops with the host values baked in at capture, like a
    device: without the update the output goes wrong, so the test would catch a runner that forgot it."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGEDLLM_ASCEND_ACL_GRAPH", "1")
    monkeypatch.delenv("PAGEDLLM_DISABLE_GRAPHS", raising=False)
    code = (GRAPHS.replace("MODEL", repr(tiny_llama)).replace("PROMPTS", repr(PROMPTS))
            .replace("MAX)", f"{MAX_TOKENS})"))
    got = json.loads(run_on_sim(code, tmp_path).split("RESULT ", 1)[1])
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).eval()
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    updated, stale = got["True"], got["False"]
    assert updated["level"] == "decode" and updated["captured"] == [4, 2, 1] and updated["replays"] >= MAX_TOKENS - 1
    assert updated["tokens"] == want, (updated["tokens"], want)
    assert stale["replays"] >= MAX_TOKENS - 1 and stale["tokens"] != want


SWAP = """
import json
from pagedllm import LLM, SamplingParams
out = {}
for name, blocks, swap in (("roomy", 16, 0), ("tight", 5, 0.001)):
    llm = LLM(model=MODEL, device="ascend", dtype="float16", skip_tokenizer_init=True, max_model_len=384,
              max_num_seqs=4, num_gpu_blocks_override=blocks, swap_space=swap)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=24),
                       use_tqdm=False)
    st = llm.llm_engine.get_stats()
    out[name] = dict(swaps=st.num_swaps, preemptions=st.num_preemptions,
                     tokens=[list(o.outputs[0].token_ids) for o in res])
    del llm
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_swap_preemption_on_the_simulated_npu_resumes_identically(tiny_llama, tmp_path):
    """5 blocks of 128 for two 250-token prompts that grow into a third block, and a third prompt waiting: a
    request holding 2 blocks is swapped out to the plugin's host caches (a K/V pair per layer, pageable on the
    simulation) and back through its swap hook; outputs equal those of a run that never preempts."""
    prompts = [[int(t) for t in torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (250, 251, 130)]
    code = SWAP.replace("MODEL", repr(tiny_llama)).replace("PROMPTS", repr(prompts))
    got = json.loads(run_on_sim(code, tmp_path).split("RESULT ", 1)[1])
    assert got["tight"]["swaps"] > 0 and got["roomy"]["preemptions"] == 0, got
    assert got["tight"]["tokens"] == got["roomy"]["tokens"]
