"""The Gaudi plugin end to end on the SIMULATED habana_frameworks (tests/support/sim/habana_frameworks, fake-HPU mode on
host tensors). Each check runs in a subprocess with tests/support/sim on PYTHONPATH; the ``child_*`` functions are that
subprocess's side and print one JSON line. What passes here is verified on CPU simulation, not on a Gaudi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_parity import hf_greedy

HERE = Path(__file__).resolve().parent
SUPPORT = HERE.parents[1] / "support"
SIM_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT / "sim"), str(HERE), str(SUPPORT)]),
           "VLLM_USE_FAKE_HPU": "1", "PT_HPU_LAZY_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ENGINE = dict(device="gaudi", dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=128)
#: 124 + 8 tokens cross the 128-token block boundary while decoding, 200 while prefilling (in 128-token chunks).
PROMPT_LENS = (124, 120, 200, 5)


def _child(call: str, extra_env: dict | None = None, timeout: int = 900) -> dict:
    code = f"import test_gaudi_sim as t; t.{call}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**SIM_ENV, **(extra_env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


# ---- subprocess side --------------------------------------------------------------------------------------------
def child_conformance(allow: list | None, exclude: list | None) -> None:
    from pagedllm.conformance.runner import run_conformance

    report = run_conformance("gaudi", allow=allow, exclude=exclude)
    print(json.dumps({"rows": [[r.id, r.feature, r.status, r.error] for r in report.results],
                      "device": report.device}))


def child_engine(path: str, graphs: bool, blocks: int | None) -> None:
    import habana_frameworks.torch as ht

    from pagedllm import LLM, SamplingParams

    llm = LLM(path, num_gpu_blocks_override=blocks, **ENGINE)
    worker = llm.llm_engine.worker
    at_model: list = []
    llm.llm_engine.model.register_forward_pre_hook(
        lambda mod, args: at_model.append((args[0].shape[0], args[2].seq_lens.shape[0],
                                           args[2].block_tables.shape[1])))
    warm = [tuple(s) for s in worker.policy.warmup_shapes()]
    after_warmup = dict(ht.STATS)
    captures_at_start = worker.graph_stats["captures"]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs], "warm": warm, "at_model": at_model,
        "runner_shapes": [list(s) for s in worker.graph_stats["shapes_seen"]],
        "runner_captures": [captures_at_start, worker.graph_stats["captures"]],
        "stats_after_warmup": after_warmup, "stats": dict(ht.STATS), "graph_level": worker.graph_level,
        "layer_mark_steps": worker.graph_stats.get("layer_mark_steps"), "block_size": worker.block_size,
        "kv_shape": list(worker.kv_caches[0][0].shape), "num_blocks": worker.num_blocks,
        "preemptions": llm.llm_engine.scheduler.num_preemptions, "device": str(worker.device),
        "policy": repr(worker.policy)}))


def child_sim_and_memory() -> None:
    import torch

    import habana_frameworks.torch as ht
    from pagedllm.backend.registry import get_backend

    be = get_backend("gaudi")
    hpu = ht.hpu
    x = torch.ones(4)
    g = hpu.HPUGraph()
    with hpu.graph(g):
        y = (x * 2).sum(0, keepdim=True)
    x.fill_(3.0)
    g.replay()
    refused = ""
    try:
        with hpu.graph(hpu.HPUGraph()):
            (x > 2).any().item()
    except RuntimeError as e:
        refused = str(e)
    mem = be.memory_info(be.device())
    be.memory_peak(be.device())
    blob = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched between the two calls
    blob.add_(1)
    peak = be.memory_peak(be.device())
    del blob
    print(json.dumps({"replayed": y.tolist(), "refused": refused, "total": mem.total_bytes, "free": mem.free_bytes,
                      "pinned": mem.pinned_host, "peak": peak, "dist": be.distributed_backend(),
                      "probe": [be.probe.usable, be.probe.reason], "device": str(be.device())}))


# ---- tests ------------------------------------------------------------------------------------------------------
def _no_failures(rows: list) -> None:
    failing = [(i, e) for i, _, s, e in rows if s == "failing"]
    assert not failing, failing[:5]


@pytest.mark.slow
def test_full_conformance_kernel_and_runtime_sweep_on_the_simulation():
    """Every kernel and runtime case of the suite, in one run. The engine-level cases (e2e greedy parity, static
    shapes) are left to the engine tests below, which assert the same against HF and the declared buckets directly
    (the static-shapes case alone took 97 s of this sweep's 115 s)."""
    res = _child("child_conformance(None, ['e2e', 'buckets_only_and_equal_to_dynamic'])", timeout=1800)
    rows = res["rows"]
    _no_failures(rows)
    passing = {i for i, _, s, _ in rows if s == "passing"}
    assert len(passing) > 150
    for kernel in ("write_kv[hs64-bs128|float32]", "gather_kv_blocks[hs64-bs128|bfloat16]",
                   "swap_kv_blocks[hs64-bs128|float32]", "paged_attention.decode[hs80-bs128-gqa3|float32]",
                   "paged_attention.mixed[hs16-bs128-gqa4|bfloat16]", "allocate_kv_cache[hs64-bs128|bfloat16]",
                   "memory_info[-|-]"):
        assert kernel in passing, kernel
    assert res["device"] == "cpu"  # fake-HPU mode: host tensors


def test_hpu_graph_engine_matches_hf_with_every_shape_a_warmed_up_bucket(tiny_model_dirs):
    """HPU graphs captured per bucket at warm-up and replayed (the simulation re-runs the recorded ops, so a value
    frozen on the host during capture would show as a wrong token), chunked prefill over 128-token blocks,
    preemption (a pool of 2 blocks), greedy tokens equal to HF transformers."""
    path = tiny_model_dirs["llama"]
    res = _child(f"child_engine({path!r}, True, 2)")
    assert res["tokens"] == [hf_greedy(path, p, 8) for p in _prompts()]
    assert res["block_size"] == 128 and res["kv_shape"] == [(res["num_blocks"] + 1) * 128, 2, 64]  # + sink block
    assert res["preemptions"] > 0 and res["graph_level"] == "full"
    warm = {tuple(s) for s in res["warm"]}
    assert {tuple(s) for s in res["runner_shapes"]} <= warm
    assert res["at_model"] == []  # every step replayed a graph: the model's Python forward never ran
    start, end = res["runner_captures"]
    assert start == end == 2 * len(warm)  # forward and forward+sampling per bucket, all before the first request
    s0, s1 = res["stats_after_warmup"], res["stats"]
    assert s0["captures"] == s1["captures"] == start
    # mark_step where claimed: after each of the 2 decoder layers while a graph is captured, and once at the end of
    # every step (every run/sample call replays its graph once).
    assert res["layer_mark_steps"] == 2
    assert s1["mark_step"] == 2 * s1["captures"] + s1["replays"]
    assert s1["replays"] - s0["replays"] > len(_prompts())  # prefill chunks and decodes, all replays


def test_eager_mode_shapes_seen_by_the_model_are_declared_buckets(tiny_model_dirs):
    """Graphs off (PAGEDLLM_DISABLE_GRAPHS=1): the model runs every step, so its recorded input shapes are exactly
    what the device would compile; each is one of the warmed-up buckets; tokens equal HF."""
    path = tiny_model_dirs["llama"]
    res = _child(f"child_engine({path!r}, False, None)", {"PAGEDLLM_DISABLE_GRAPHS": "1"})
    assert res["tokens"] == [hf_greedy(path, p, 8) for p in _prompts()]
    warm = {tuple(s) for s in res["warm"]}
    seen = {tuple(s) for s in res["at_model"]}
    assert seen and seen <= warm, seen - warm
    assert any(t == 128 for t, _, _ in seen) and any(w == 2 for _, _, w in seen)  # chunks; two-block tables
    assert res["stats"]["captures"] == 0
    # Lazy mode without graphs: mark_step after each of the 2 decoder layers of every forward, and once at the end
    # of each step (one forward per step).
    steps = res["stats"]["mark_step"] - res["stats_after_warmup"]["mark_step"]
    assert steps == 3 * len(res["at_model"])


def test_simulated_graphs_memory_and_collectives():
    res = _child("child_sim_and_memory()")
    assert res["replayed"] == [24.0]  # replay re-ran the recorded ops on the updated input, in place
    assert "not supported during HPU Graph capturing" in res["refused"]
    assert res["total"] == 96 << 30 and 0 < res["free"] <= res["total"] and res["pinned"] is False
    assert res["peak"] >= 32 << 20  # the 64 MiB touched between the two memory_peak calls (RSS in the sim)
    assert res["dist"] == "hccl" and res["probe"][0] and "VLLM_USE_FAKE_HPU" in res["probe"][1]
    assert res["device"] == "cpu"
