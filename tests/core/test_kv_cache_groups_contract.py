"""KV cache groups in the backend contract (contract v4, issue 28 item 1): ``pagedllm_allocate_kv_cache_groups``
receives every group (full, sliding window W, recurrent state) with core's shared-tensor layout, and a backend may lay
each group out its own way. A simulated backend that gives every layer its own tensor where core shares one across
sliding-window groups (and its own state tensors) runs Gemma-2/3-shaped and hybrid (LFM2, Qwen3-Next) tiny models
to the same greedy tokens as core's default path; a v3 plugin without the hook still loads and runs on its old
allocators; a bad return is refused naming the backend and the group."""

from __future__ import annotations

import pytest
import torch
from pagedllm import LLM, SamplingParams
from pagedllm.backend import (API_VERSION, BackendInfo, Capabilities, FullAttentionSpec, KVCacheConfig, KVCacheSpec,
                              MambaSpec, SlidingWindowSpec, hookimpl)
from pagedllm.backend.registry import BackendError, register_backend
from pagedllm.sched.kv_groups import HybridKVCacheManager
from plugin_factory import REFERENCE_FEATURES, make_plugin, per_layer_allocator
from stateful import LFM2, QWEN3_NEXT
from tiny_models import make_fallback_model, save_random_model

BS, NEW = 8, 24
CAPS = Capabilities(**REFERENCE_FEATURES, dtypes=("float32",), head_sizes=None, block_sizes=(BS,))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("kvspec")
    return {"gemma2": make_fallback_model("gemma2", root / "gemma2"),  # layer 0 slides (W 8), layer 1 is global
            "gemma3": make_fallback_model("gemma3", root / "gemma3"),  # layers 0, 2 slide, layer 1 is global
            "lfm2": save_random_model(LFM2, root / "lfm2"),  # conv, attention, conv, conv, attention
            "qwen3_next": save_random_model(QWEN3_NEXT, root / "qwen3_next"),  # the same, Gated DeltaNet
            "deepseek_v2": make_fallback_model("deepseek_v2", root / "deepseek_v2")}  # MLA: one latent row


def backend(name: str, **ops) -> str:
    return register_backend(make_plugin(name, CAPS, **ops), name).name


def engine(path: str, device: str, **kw) -> LLM:
    args = dict(device=device, dtype="float32", max_model_len=128, block_size=BS, kv_cache_memory=4 << 20,
                max_num_batched_tokens=16, max_num_seqs=4)
    return LLM(path, **{**args, **kw})


def greedy(llm: LLM, vocab: int, lens=(5, 23, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return [list(o.outputs[0].token_ids) for o in outs]


def groups_of(config: KVCacheConfig) -> list[tuple]:
    return [(g.layer_ids, type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None))
            for g in config.kv_cache_groups]


# The groups core hands the hook, and core's shared layout (tensor: the layers viewing it)
GROUPS = {
    "gemma2": ([((1,), "FullAttentionSpec", None), ((0,), "SlidingWindowSpec", 8)], [(1, 0)]),
    "gemma3": ([((1,), "FullAttentionSpec", None), ((0,), "SlidingWindowSpec", 8), ((2,), "SlidingWindowSpec", 8)],
               [(1, 0, 2)]),
    "lfm2": ([((1, 4), "FullAttentionSpec", None), ((0, 2, 3), "MambaSpec", None)], [(1,), (4,)]),
    "qwen3_next": ([((1, 4), "FullAttentionSpec", None), ((0, 2, 3), "MambaSpec", None)], [(1,), (4,)]),
    "deepseek_v2": ([((0, 1, 2), "MLAAttentionSpec", None)], [(0,), (1,), (2,)]),
}


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "lfm2", "qwen3_next", "deepseek_v2"])
def test_own_layout_per_group_matches_the_default_path(dirs, name):
    seen: list = []
    own = backend(f"kvspec-own-{name}", allocate_kv_cache_groups=per_layer_allocator(seen))
    default = backend(f"kvspec-default-{name}")
    ref = engine(dirs[name], default)
    vocab = ref.llm_engine.worker.model.vocab_size
    want = greedy(ref, vocab)
    llm = engine(dirs[name], own)
    assert len(seen) == 1
    config, allocated = seen[0]
    groups, shared = GROUPS[name]
    assert groups_of(config) == groups
    assert [t.shared_by for t in config.kv_cache_tensors] == shared
    worker = llm.llm_engine.worker
    assert config is worker.kv_cache_config and config.device == torch.device("cpu")
    paged = [g.kv_cache_spec for g in config.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec)]
    assert all((p.block_size, p.num_kv_heads, p.head_size, p.dtype) == (BS, worker.model.num_kv_heads,
                                                                       worker.model.head_size, torch.float32)
               for p in paged)
    if name == "deepseek_v2":  # the latent: one row per token, no values
        assert paged[0].num_kv_heads == 1 and paged[0].canonical_shape(5)[:2] == (1, 5)
    assert all(t.size == paged[0].page_size_bytes * config.num_blocks for t in config.kv_cache_tensors)
    caches = worker.model.kv_caches
    assert len({id(c) for c in caches}) == len(caches), "each paged layer has its own tensor"
    paged_ids = sorted(i for g in config.kv_cache_groups if g.kind != "state" for i in g.layer_ids)
    assert all(c is allocated[i] for c, i in zip(caches, paged_ids, strict=True))  # what the layers read
    if name.startswith("gemma"):
        assert isinstance(llm.llm_engine.kv, HybridKVCacheManager)
        assert len(worker.kv_caches) == len(caches)  # swap / connectors see every distinct cache
    if name in ("lfm2", "qwen3_next"):
        state = next(g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
        assert state.num_layers == 3 and state.num_slots == 4 and len(worker.model.state_caches) == 3
        assert all(c is allocated[i] for c, i in zip(worker.model.state_caches, (0, 2, 3), strict=True))
    assert greedy(llm, vocab) == want
    if name.startswith("gemma"):
        assert llm.llm_engine.kv.num_freed_by_window > 0  # the window groups freed blocks on the backend's layout

def test_one_table_path_hands_full_groups_that_keep_the_window(dirs):
    """With the hybrid manager off, every layer keeps all its blocks: Gemma 2's sliding layer comes as a
    ``FullAttentionSpec`` with its ``sliding_window`` (vLLM's field), one tensor per layer."""
    seen: list = []
    name = backend("kvspec-one-table", allocate_kv_cache_groups=per_layer_allocator(seen))
    engine(dirs["gemma2"], name, disable_hybrid_kv_cache_manager=True)
    config = seen[0][0]
    assert groups_of(config) == [((1,), "FullAttentionSpec", None), ((0,), "FullAttentionSpec", 8)]
    assert [t.shared_by for t in config.kv_cache_tensors] == [(0,), (1,)]


def v3_plugin(name: str, calls: list):
    """A plugin built for contract v3 (API_VERSION - 1): its own allocators, no groups hook."""
    from pagedllm.backend import conv_ops, ref_ops

    def allocate_kv_cache(spec: KVCacheSpec) -> list:
        calls.append(spec)
        return ref_ops.allocate_kv_cache(spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                                         spec.head_size, spec.dtype, spec.device, mla=spec.mla)

    def allocate_state_cache(spec: MambaSpec) -> list:
        calls.append(spec)
        return conv_ops.allocate_state_cache(spec)

    plugin = make_plugin(name, CAPS, allocate_kv_cache=allocate_kv_cache, allocate_state_cache=allocate_state_cache)
    plugin.pagedllm_backend_info = hookimpl(lambda: BackendInfo(name=name, device_type="cpu",
                                                                api_version=API_VERSION - 1))
    return plugin


@pytest.mark.parametrize("name", ["gemma3", "lfm2"])
def test_v3_plugin_without_the_hook_runs_on_its_old_allocators(dirs, name):
    calls: list = []
    old = register_backend(v3_plugin(f"kvspec-v3-{name}", calls), f"kvspec-v3-{name}")
    assert old.info.api_version == API_VERSION - 1 == 3
    assert not old.implements("pagedllm_allocate_kv_cache_groups")
    want = greedy(engine(dirs[name], backend(f"kvspec-ref-{name}")), 500)
    llm = engine(dirs[name], old.name)
    kv_specs = [c for c in calls if isinstance(c, KVCacheSpec) and c.num_blocks > 1]  # (not profiling scratch)
    assert len(kv_specs) == 1
    worker = llm.llm_engine.worker
    assert kv_specs[0] == worker.kv_spec  # exactly v3's call: group_size layers with groups, else every layer
    if name == "gemma3":
        assert kv_specs[0].num_layers == 1
        caches = worker.model.kv_caches
        assert caches[0] is caches[1] is caches[2]  # core's shared layout, unchanged
    else:
        assert kv_specs[0].num_layers == 2
        assert [c for c in calls if isinstance(c, MambaSpec)] == [worker.state_spec]
    assert greedy(llm, 500) == want


def bad_allocator(break_layer):
    """Core's groups, then ``break_layer(config, caches)`` spoils one."""
    def allocate(config: KVCacheConfig) -> dict:
        caches = per_layer_allocator()(config)
        break_layer(config, caches)
        return caches
    return allocate


def _sliding(config):
    return next(g for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, SlidingWindowSpec)).layer_ids[0]


@pytest.mark.parametrize("case,model,spoil,message", [
    ("missing", "gemma3", lambda c, caches: caches.pop(2),
     r"layer 2 of KV cache group 2 \(sliding_window, layers \[2\]\): missing"),
    ("shape", "gemma2", lambda c, caches: caches.__setitem__(_sliding(c), caches[_sliding(c)][:, :-1]),
     r"layer 0 of KV cache group 1 \(sliding_window, layers \[0\]\): shape \(2, \d+, 8, 2, 48\), want "
     r"\(2, \d+, 8, 2, 48\)"),
    ("dtype", "gemma2", lambda c, caches: caches.__setitem__(1, caches[1].double()),
     r"layer 1 of KV cache group 0 \(full, layers \[1\]\): dtype torch.float64, want torch.float32"),
    ("device", "lfm2", lambda c, caches: caches.__setitem__(4, caches[4].to("meta")),
     r"layer 4 of KV cache group 0 \(full, layers \[1, 4\]\): on meta, want cpu"),
    ("state", "lfm2", lambda c, caches: caches.__setitem__(3, caches[3][0]),
     r"layer 3 of KV cache group 1 \(state, layers \[0, 2, 3\]\): want a tuple of 1 state tensors"),
    ("extra", "lfm2", lambda c, caches: caches.__setitem__(7, caches[1]),
     r"caches for layers \[7\], which are in no KV cache group"),
])
def test_bad_return_is_refused_naming_the_backend_and_group(dirs, case, model, spoil, message):
    name = backend(f"kvspec-bad-{case}", allocate_kv_cache_groups=bad_allocator(spoil))
    with pytest.raises(BackendError, match=rf"backend 'kvspec-bad-{case}': pagedllm_allocate_kv_cache_groups "
                                           rf"returned .*{message}"):
        engine(dirs[model], name)


def test_contract_lists_the_groups_hook_and_its_specs():
    from pagedllm.backend import hookspec

    assert API_VERSION == 4 and "pagedllm_allocate_kv_cache_groups" in hookspec.HOOK_NAMES
    caller = hookspec.BackendSpec.pagedllm_allocate_kv_cache_groups
    assert caller.pagedllm_spec["firstresult"]
    sw = SlidingWindowSpec(BS, 2, 48, torch.float32, sliding_window=8)
    assert sw.page_size_bytes == FullAttentionSpec(BS, 2, 48, torch.float32).page_size_bytes == 2 * BS * 2 * 48 * 4
