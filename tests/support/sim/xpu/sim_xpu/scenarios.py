"""Scenarios run in a fresh process each: ``python -m sim_xpu.scenarios <name> [args]`` prints one JSON line."""

from __future__ import annotations

import json
import sys
import time


def _report_summary(report) -> dict:
    return {"counts": report.counts(),
            "failing": [f"{r.id}: {r.error}" for r in report.failing],
            "passing": [r.id for r in report.results if r.status == "passing"],
            "graph_detail": next((r.detail for r in report.results if r.feature == "graph"), ""),
            "seconds": {r.id: r.seconds for r in report.results if r.status != "untested"}}


def imports() -> dict:
    """Load both plugin modules and run their probes on this machine: nothing vendor may be imported."""
    from pagedllm.backend.registry import discover

    found = discover()
    out = {name: {"usable": d.backend.probe.usable, "reason": d.backend.probe.reason, "error": d.error}
           for name, d in found.items() if name in ("xpu", "ipex") and d.backend}
    out["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "intel_extension_for_pytorch"))
    return out


def probe_sim() -> dict:
    """The xpu runtime hooks against the simulated torch.xpu."""
    import torch
    from sim_xpu.torch_xpu import cpu_backend, install

    state = install()
    be = cpu_backend()
    caps = be.capabilities
    dev = torch.device("xpu", 0)
    state.peak_bytes = 3 << 30
    mi = be.memory_info(dev)
    peak = be.memory_peak(dev)
    be.set_device(dev)
    be.synchronize(dev)
    state.bf16 = False
    from pagedllm.backend.registry import Backend

    caps_no_bf16 = Backend(be.plugin, "xpu-again").capabilities
    config = _a770_update_config(be)
    import os

    os.environ["PAGEDLLM_XPU_GRAPHS"] = "0"
    eager = Backend(be.plugin, "xpu-eager")
    eager_runner = eager.graph_runner(lambda *a: None, 2, torch.device("cpu"), None)
    return {"probe": [be.probe.usable, be.probe.reason, be.probe.device_name], "dtypes": list(caps.dtypes),
            "dtypes_no_bf16": list(caps_no_bf16.dtypes), "graph_capture": caps.graph_capture,
            "memory": [mi.total_bytes, mi.free_bytes, mi.pinned_host], "peak": peak,
            "peak_after_reset": state.peak_bytes, "dist": be.distributed_backend(),
            "calls": [list(c) for c in state.calls], "update_config": config,
            "graphs_off": [eager.capabilities.graph_capture, eager_runner.level]}


def _a770_update_config(be) -> dict:
    """The config hook on the default simulated GPU and on an Arc A770 (bf16 refused / auto -> fp16)."""
    from types import SimpleNamespace

    import torch

    from pagedllm.backend.hookspec import ModelInfo
    from pagedllm.errors import ParamError

    info = ModelInfo("LlamaForCausalLM", "bfloat16", 2, 4, 2, 64, 128, 512)
    out = {"max1550_auto": be.update_config(SimpleNamespace(dtype="auto"), info)}
    torch.xpu.get_device_name = lambda device=None: "Intel(R) Arc(TM) A770 Graphics"
    out["a770_auto"] = be.update_config(SimpleNamespace(dtype="auto"), info)
    out["a770_fp32"] = be.update_config(SimpleNamespace(dtype="float32"), info)
    try:
        be.update_config(SimpleNamespace(dtype="bfloat16"), info)
        out["a770_bf16"] = "accepted"
    except ParamError as e:
        out["a770_bf16"] = f"ParamError({e.field}): {e}"
    return out


def conformance(*allow: str) -> dict:
    """Core's conformance suite on the xpu backend (simulated device, Triton interpreter), selected cases."""
    from sim_xpu.torch_xpu import cpu_backend, install

    from pagedllm.conformance.runner import run_conformance

    install()
    be = cpu_backend()
    t0 = time.perf_counter()
    report = run_conformance(be, allow=list(allow) or None, exclude=["*|bfloat16]"], gqa_ratios=(3,))
    out = _report_summary(report)
    out["total_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def graph() -> dict:
    """The xpu graph runner over the recording XPUGraph: Python is not re-run on replay, replays see new inputs,
    Triton launches were captured, and a host sync inside capture fails as on a device."""
    import torch
    from sim_xpu.graph_recorder import HostSyncInCapture, RecordingGraph
    from sim_xpu.torch_xpu import cpu_backend, install

    from pagedllm.backend.attention import AttentionMetadata

    install()
    be = cpu_backend()
    calls = []

    def model(ids, pos, meta):  # python side effect: counts how often the host code runs
        calls.append(int(ids.shape[0]))
        x = be.silu_and_mul(torch.stack([ids.float(), pos.float()], dim=-1).repeat(1, 2) + 1.0)
        return x * meta.seq_lens[:, None].float()

    runner = be.graph_runner(model, 2, torch.device("cpu"))
    results = []
    for ids, pos, lens in (([3], [4], [5]), ([7, 2], [1, 6], [2, 7]), ([5], [9], [10])):
        meta = AttentionMetadata.build([1] * len(ids), lens, [[0]] * len(ids), 16)
        out = runner.run(torch.tensor(ids), torch.tensor(pos), meta)
        want = model(torch.tensor(ids), torch.tensor(pos), meta)
        calls.pop()
        results.append(bool(torch.allclose(out, want)))
    graphs = [g for g in RecordingGraph.instances]
    sync_error = ""
    try:
        def syncing(ids, pos, meta):
            return ids.float() * float(meta.seq_lens.max())  # .item(): a host sync

        sync_runner = be.graph_runner(syncing, 1, torch.device("cpu"))
        sync_runner.run(torch.tensor([1]), torch.tensor([0]), AttentionMetadata.build([1], [3], [[0]], 16))
    except HostSyncInCapture as e:
        sync_error = str(e)
    return {"level": runner.level, "stats": {k: v for k, v in runner.stats.items()}, "results": results,
            "python_calls": calls, "graph_launches": [g.launches for g in graphs[:2]],
            "graph_replays": [g.replays for g in graphs[:2]], "sync_error": sync_error}


def e2e(head_size: str = "64") -> dict:
    """Greedy generation through ``pagedllm.LLM`` on the xpu backend (Worker: set_device, profiling run with the
    peak-memory hooks, KV sizing from mem_get_info, XPU graph capture from the Worker's RunnerContext, replays) vs
    HF transformers on the same tiny random Llama. Small budgets keep the interpreted kernels' grids small."""
    from sim_xpu.graph_recorder import RecordingGraph
    from sim_xpu.torch_xpu import cpu_backend, install

    from pagedllm import LLM, SamplingParams
    from pagedllm.conformance.checks_e2e import MAX_TOKENS, hf_greedy, selected_by_name, tiny_llama

    state = install()
    state.total_bytes, state.free_bytes, state.allocated_bytes = 256 << 20, 192 << 20, 24 << 20
    be = cpu_backend()
    path = tiny_llama(int(head_size))
    prompts = [[5, 9, 17, 33, 4], list(range(3, 23)), [7] * 3 + list(range(40, 50))]
    want = hf_greedy(path, prompts)
    t0 = time.perf_counter()
    with selected_by_name(be):
        llm = LLM(model=path, device="xpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    worker = llm.llm_engine.worker
    spec_bytes = worker._kv_spec(1).bytes_per_block
    return {"got": [list(o.outputs[0].token_ids) for o in outs], "want": want,
            "graph_level": llm.llm_engine.graph_level, "block_size": worker.block_size,
            "num_blocks": worker.num_blocks, "bytes_per_block": spec_bytes,
            "graphs": len(RecordingGraph.instances), "graph_replays": sum(g.replays for g in RecordingGraph.instances),
            "calls": sorted({c[0] for c in state.calls}), "seconds": round(time.perf_counter() - t0, 1)}


def ipex_probe(marker: str = "") -> dict:
    """The ipex backend's probe with whatever IPEX the PYTHONPATH holds; did anything import it?"""
    import os

    from pagedllm.backend.registry import discover

    d = discover()["ipex"]
    probe = d.backend.probe
    return {"usable": probe.usable, "reason": probe.reason, "device_name": probe.device_name,
            "imported": "intel_extension_for_pytorch" in sys.modules,
            "marker": bool(marker) and os.path.exists(marker)}


def ipex_conformance(*allow: str) -> dict:
    """Core's conformance suite on the ipex backend over the fake IPEX (reference semantics)."""
    from pagedllm.backend.registry import get_backend
    from pagedllm.conformance.runner import run_conformance

    be = get_backend("ipex")
    t0 = time.perf_counter()
    report = run_conformance(be, allow=list(allow) or None, gqa_ratios=(1, 3))
    from intel_extension_for_pytorch.llm.modules import CALLS

    out = _report_summary(report)
    out["untested"] = {r.id: r.error for r in report.results if r.status == "untested"}
    out["ipex_calls"] = sorted(set(CALLS))
    out["total_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str]) -> None:
    name, args = argv[0], argv[1:]
    result = globals()[name](*args)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
