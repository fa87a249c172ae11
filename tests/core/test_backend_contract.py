"""Contract v2 as a vendor meets it: config hook, capability checks before loading, one implementation per hook,
host caches and profiling through the backend, and a model of any head size on the CPU backend."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import tiny_models
from pagedllm import LLM, SamplingParams
from pagedllm.backend import ref_ops
from pagedllm.backend.registry import Backend, register_backend
from pagedllm.config import EngineConfig, resolve_config
from pagedllm.backend.hookspec import (HOOK_NAMES, RETIRED_HOOK_NAMES, Capabilities, KVCacheSpec, MemoryInfo,
                                       ModelInfo)
from pagedllm.models import load_config
from pagedllm.models.info import read_model_info
from pagedllm.errors import ParamError
from plugin_factory import make_plugin
from engine_parity import hf_greedy, mixed_prompts, run

INFO = ModelInfo("LlamaForCausalLM", "bfloat16", 2, 4, 2, 64, 512, 512)


def backend(name: str, caps: Capabilities = Capabilities(head_sizes=(64,)), **ops) -> Backend:
    return Backend(make_plugin(name, caps, **ops), name)


def test_config_hook_picks_block_size_before_loading(tiny_llama):
    seen = {}

    def update_config(config, model_info):
        seen["block_size"], seen["info"] = config.block_size, model_info
        return {"block_size": 128} if config.block_size is None else None

    caps = Capabilities(head_sizes=(64,), block_sizes=(16, 128))
    cfg = resolve_config(EngineConfig(model=tiny_llama), backend("blk", caps, update_config=update_config),
                         read_model_info(tiny_llama, load_config(tiny_llama)))
    assert cfg.block_size == 128 and seen["block_size"] is None
    assert seen["info"].head_size == 64 and seen["info"].num_kv_heads == 2 and seen["info"].max_model_len == 512
    # Unset block size without a hook: the backend's first (preferred) size; the checkpoint dtype when supported.
    cfg = resolve_config(EngineConfig(), backend("plain", Capabilities(dtypes=("float32", "bfloat16"),
                                                                       head_sizes=(64,), block_sizes=(64, 16))), INFO)
    assert (cfg.block_size, cfg.dtype, cfg.max_model_len) == (64, "bfloat16", 512)


def test_config_hook_refusals_name_the_field():
    def refuse(config, model_info):
        raise ParamError("max_model_len", "this device compiles at most 256 positions")

    with pytest.raises(ParamError, match="max_model_len: this device compiles"):
        resolve_config(EngineConfig(), backend("refuse", update_config=refuse), INFO)
    with pytest.raises(ParamError, match="seed: backend 'sneaky' may only set"):
        resolve_config(EngineConfig(), backend("sneaky", update_config=lambda config, model_info: {"seed": 3}), INFO)
    with pytest.raises(ParamError, match="block_size: must be a power of two"):
        resolve_config(EngineConfig(), backend("bad", update_config=lambda config, model_info: {"block_size": 12}),
                       INFO)


@pytest.mark.parametrize("info,caps,field,match", [
    (replace(INFO, sliding_window=8), Capabilities(head_sizes=(64,), sliding_window=False), "model", "sliding-window"),
    (replace(INFO, soft_cap=30.0), Capabilities(head_sizes=(64,), soft_cap=False), "model", "soft-capping"),
    (replace(INFO, alibi=True), Capabilities(head_sizes=(64,)), "model", "ALiBi attention.*Capabilities.alibi"),
    (replace(INFO, head_size=16), Capabilities(head_sizes=(64, 128)), "model", "head size 16"),
    (INFO, Capabilities(head_sizes=(64,), block_sizes=(128,)), "block_size", "supports \\(128,\\), not 16"),
])
def test_capabilities_are_enforced_before_loading(info, caps, field, match):
    cfg = EngineConfig(block_size=16) if field == "block_size" else EngineConfig()
    # The backend's own attention (core's reference attention, which does ALiBi, would declare alibi for it).
    with pytest.raises(ParamError, match=match) as e:
        resolve_config(cfg, backend("caps", caps, paged_attention=ref_ops.paged_attention), info)
    assert e.value.field == field


def test_reference_attention_declares_alibi():
    """A backend without its own paged attention runs core's reference, which implements ALiBi."""
    assert backend("refattn").capabilities.alibi
    assert not backend("ownattn", paged_attention=ref_ops.paged_attention).capabilities.alibi
    assert resolve_config(EngineConfig(), backend("refattn"), replace(INFO, alibi=True)).block_size == 16


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ParamError, match="kv_cache_dtype: backend 'kvd' supports auto, not 'fp8'"):
        resolve_config(EngineConfig(kv_cache_dtype="fp8"), backend("kvd"), INFO)


def test_in_place_hooks_never_fall_through_to_the_reference(monkeypatch):
    """A tuple layout's own swap returning None is the whole implementation: the reference never runs after it."""
    calls = []

    def refuse(*a, **k):
        raise AssertionError("reference op ran on the backend's own layout")

    monkeypatch.setattr(ref_ops, "swap_kv_blocks", refuse)
    monkeypatch.setattr(ref_ops, "write_kv", refuse)
    b = backend("tuples", swap_kv_blocks=lambda src_caches, dst_caches, src, dst: calls.append("swap"),
                write_kv=lambda key, value, kv_cache, slot_mapping: calls.append("write"))
    caches = [(torch.zeros(2, 4), torch.zeros(2, 4))]
    b.swap_kv_blocks(caches, caches, torch.tensor([0]), torch.tensor([1]))
    b.write_kv(torch.zeros(1), torch.zeros(1), caches[0], torch.tensor([0]))
    assert calls == ["swap", "write"]


def test_a_plugin_implementing_a_retired_hook_still_loads():
    """``pagedllm_copy_kv_blocks`` was retired (core never copies blocks): a plugin written against the earlier v2
    contract that implements it loads with one DeprecationWarning naming it, and the hook is never bound."""
    calls = []
    with pytest.warns(DeprecationWarning, match=r"retired hook\(s\) \['pagedllm_copy_kv_blocks'\]") as w:
        b = backend("retired", copy_kv_blocks=lambda kv_caches, src, dst: calls.append("copy"))
    assert len([x for x in w if issubclass(x.category, DeprecationWarning)]) == 1
    assert "pagedllm_copy_kv_blocks" in RETIRED_HOOK_NAMES and "pagedllm_copy_kv_blocks" not in HOOK_NAMES
    assert not hasattr(b, "copy_kv_blocks") and b.info.name == "retired" and calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plugin without retired hooks loads silently
        backend("current")


def test_hook_implementations_may_name_fewer_arguments_than_the_spec():
    """v1 graph runners take no ``ctx``; core passes each implementation only what it names."""
    got = []
    b = backend("v1graph", graph_runner=lambda model, max_num_seqs: got.append((model, max_num_seqs)) or "runner")
    assert b.graph_runner("m", 4, torch.device("cpu"), ctx=None) == "runner" and got == [("m", 4)]


def test_host_caches_come_from_the_backend(tiny_llama):
    made = []

    def allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
        made.append((spec.device.type, spec.num_blocks, pin_memory))
        return ref_ops_alloc(spec)

    def ref_ops_alloc(spec):
        return ref_ops.allocate_kv_cache(spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                                         spec.head_size, spec.dtype, spec.device)

    name = "hostcache"
    register_backend(make_plugin(name, Capabilities(head_sizes=(64,)),
                                 allocate_host_kv_cache=allocate_host_kv_cache), name)
    llm = LLM(tiny_llama, device=name, dtype="float32", max_model_len=128, num_gpu_blocks_override=12,
              swap_space=0.001)
    assert made and made[0][0] == "cpu" and made[0][2] is False  # make_plugin's memory_info: no pinned host
    prompts = mixed_prompts(6, 512, seed=5, max_len=50)
    assert run(llm, prompts) == [hf_greedy(tiny_llama, p, 12) for p in prompts]
    assert llm.llm_engine.scheduler.num_swaps > 0


def test_profiling_forward_sizes_the_pool_from_measured_peak(tiny_llama):
    """gpu_memory_utilization x total - used after load - activation peak, as vLLM budgets it."""
    peaks = iter([0, 300 << 20])  # the reset before the profiling forward, then its peak
    calls = []

    def memory_peak(device):
        calls.append(device)
        return next(peaks)

    name = "profiled"
    register_backend(make_plugin(name, Capabilities(head_sizes=(64,)), memory_peak=memory_peak), name)
    llm = LLM(tiny_llama, device=name, dtype="float32", max_model_len=128, gpu_memory_utilization=0.6,
              max_num_seqs=1 << 14)
    w = llm.llm_engine.worker
    bpb = KVCacheSpec(2, 1, 16, 2, 64, torch.float32, w.device).bytes_per_block
    budget = 0.6 * (8 << 30) - (4 << 30) - (300 << 20)  # make_plugin: 8 GiB total, 4 GiB free
    assert len(calls) == 2 and w.num_blocks == int(budget // bpb)


def test_cpu_backend_runs_any_head_size(tmp_path):
    path = tiny_models.make_tiny_model("llama", tmp_path / "hd16", head_dim=16)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128)
    assert llm.llm_engine.model.head_size == 16
    prompts = mixed_prompts(4, 512, seed=6, max_len=40)
    assert run(llm, prompts) == [hf_greedy(path, p, 12) for p in prompts]
