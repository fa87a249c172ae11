"""Sliding-window KV groups end to end (issue 28 item 2): Gemma-2/3-, Mistral- and Qwen2-shaped tiny models (window
8, block 8) whose prompts and outputs span several windows: greedy parity with HF transformers and with the groups
turned off, blocks per request bounded by the window, prefix-cache hits after freeing, preemption under a tiny
pool, abort, chunked prefill with a 16-token budget."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import hf_oracle
import pytest
import torch
from engine_parity import hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.sched.kv_groups import HybridKVCacheManager, choose_kv_layout
from tiny_models import make_fallback_model, make_tiny_model

W, BS, NEW = 8, 8, 30
LENS = (5, 23, 40)  # up to 70 tokens with the outputs: 9 windows


@pytest.fixture(scope="module")
def swa_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("swa")
    return {"llama": make_tiny_model("llama", root / "llama"),  # full attention only
            "gemma2": make_fallback_model("gemma2", root / "gemma2"),  # alternating sliding / global, soft-caps
            "gemma3": make_fallback_model("gemma3", root / "gemma3"),  # 2 sliding : 1 global
            "mistral": make_tiny_model("mistral", root / "mistral"),  # every layer slides
            "qwen2_swa": make_tiny_model("qwen2", root / "qwen2_swa", use_sliding_window=True, sliding_window=W,
                                         max_window_layers=1)}


def prompts(vocab: int, lens=LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def engine(path: str, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_model_len=128, block_size=BS, kv_cache_memory=4 << 20,
                max_num_batched_tokens=16)
    return LLM(path, **{**args, **kw})


def greedy(llm: LLM, batch: list[list[int]], n: int = NEW) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral", "qwen2_swa"])
def test_greedy_parity_with_hf_and_with_freeing_off(swa_dirs, name):
    path = swa_dirs[name]
    hf = hf_model(path)
    batch = prompts(hf.config.vocab_size)
    want = [hf_oracle.hf_greedy(hf, p, NEW) for p in batch]
    llm = engine(path)
    kv = llm.llm_engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    assert greedy(llm, batch) == want
    assert kv.num_freed_by_window > 0
    off = engine(path, disable_hybrid_kv_cache_manager=True)
    assert not isinstance(off.llm_engine.kv, HybridKVCacheManager)
    assert greedy(off, batch) == want


def test_layers_share_kv_tensors_and_a_block_costs_one_groups_layers(swa_dirs):
    """Gemma 2's sliding and global layer (groups of one layer) view one KV tensor: a block id costs one layer, so
    the same KV memory holds twice the blocks of the one-table layout."""
    on, off = engine(swa_dirs["gemma2"]), engine(swa_dirs["gemma2"], disable_hybrid_kv_cache_manager=True)
    caches = on.llm_engine.model.kv_caches
    assert len(caches) == 2 and caches[0] is caches[1]
    assert off.llm_engine.model.kv_caches[0] is not off.llm_engine.model.kv_caches[1]
    assert on.llm_engine.num_blocks == 2 * off.llm_engine.num_blocks


def test_blocks_held_per_request_are_bounded_by_the_window(swa_dirs):
    llm = engine(swa_dirs["gemma3"])
    eng = llm.llm_engine
    kv, layout = eng.kv, eng.worker.kv_layout
    batch = prompts(500, (40, 61))
    for i, p in enumerate(batch):
        eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40,
                                                                        ignore_eos=True))
    reqs = list(eng.scheduler.waiting)
    seen_decode = False
    while eng.has_unfinished_requests():
        eng.step()
        for r in reqs:
            if r.is_finished or r.request_id not in kv.req_tables:
                continue
            decoding = r.num_computed_tokens > r.num_prompt_tokens
            seen_decode |= decoding
            for g, spec in enumerate(layout.groups):
                held = kv.num_blocks_of_group(r.request_id, g)
                if spec.sliding_window is None:
                    assert held >= -(-r.num_computed_tokens // BS)  # every block written so far
                else:  # the window plus the step's chunk (16 tokens of prefill, one of decode)
                    bound = -(-(W - 1 + (1 if decoding else 16)) // BS) + 1
                    assert held <= bound, (r.request_id, g, r.num_computed_tokens, held)
    assert seen_decode and kv.num_used_blocks == 0 and kv.num_freed_by_window > 0


def test_prefix_cache_hit_after_freeing_gives_the_same_tokens(swa_dirs):
    path = swa_dirs["gemma2"]
    hf = hf_model(path)
    first = prompts(hf.config.vocab_size, (45,), seed=3)[0]
    llm = engine(path)
    out = greedy(llm, [first])[0]
    assert llm.llm_engine.kv.num_freed_by_window > 0  # the first request's early window blocks were freed
    hits = llm.llm_engine.get_stats().prefix_hits
    second = first + out[:10] + [7, 9, 11]  # shares the first's prompt and part of its output
    got = greedy(llm, [second])[0]
    assert got == hf_oracle.hf_greedy(hf, second, NEW)
    assert llm.llm_engine.get_stats().prefix_hits - hits >= 48  # 6 blocks of 8 served from the cache


def test_preemption_under_a_tiny_pool(swa_dirs):
    path = swa_dirs["gemma3"]
    hf = hf_model(path)
    batch = prompts(hf.config.vocab_size, (9, 17, 30, 33, 40, 12), seed=5)
    # 3 groups: a 128-token sequence needs 16 full-group blocks + 2 x 4 window blocks; 30 blocks hold ~1.2 of them
    llm = engine(path, num_gpu_blocks_override=30, swap_space=0.01)
    assert isinstance(llm.llm_engine.kv, HybridKVCacheManager)
    assert llm.llm_engine.worker.num_host_blocks == 0  # KV groups preempt by recompute (no swap space)
    got = greedy(llm, batch, n=40)
    assert llm.llm_engine.scheduler.num_preemptions > 0 and llm.llm_engine.scheduler.num_swaps == 0
    assert got == [hf_oracle.hf_greedy(hf, p, 40) for p in batch]


def test_abort_and_finish_leave_no_block_in_any_group(swa_dirs):
    llm = engine(swa_dirs["mistral"])
    eng = llm.llm_engine
    for i, p in enumerate(prompts(500, (40, 50, 7), seed=2)):
        eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=50,
                                                                        ignore_eos=True))
    for _ in range(6):  # mid-prefill for one, decoding for another
        eng.step()
    assert eng.kv.num_used_blocks > 0
    eng.abort_request(["0", "1", "2"])
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv.num_used_blocks == 0 and not eng.kv.req_tables


def test_backends_that_hold_one_table_get_one_group_with_a_log_line(swa_dirs, caplog):
    llm = engine(swa_dirs["gemma2"])
    model, config = llm.llm_engine.model, llm.llm_engine.config
    with caplog.at_level(logging.INFO, logger="pagedllm.sched.kv_groups"):
        assert choose_kv_layout(model, config, "none", static=True) is None
        assert choose_kv_layout(model, config, "decode", static=False) is None
        assert choose_kv_layout(model, config, "none", static=False, own_runner=True) is None
    assert "static batch shapes" in caplog.text and "captures graphs (decode)" in caplog.text
    assert "its own model runner" in caplog.text
    assert choose_kv_layout(model, config, "none", static=False).num_groups == 2


def test_full_attention_models_keep_one_table_and_todays_path(swa_dirs):
    llm = engine(swa_dirs["llama"])
    eng = llm.llm_engine
    assert type(eng.kv).__name__ == "KVCacheManager" and eng.worker.kv_layout is None
    assert not eng.worker.runner.kv_groups
    assert all(layer.self_attn.kv_group == 0 for layer in eng.model.layers)
    eng.add_request("x", {"prompt_token_ids": prompts(500, (20,))[0]}, SamplingParams(max_tokens=2))
    out = eng.scheduler.schedule()
    meta = eng.worker.runner.prepare(out.scheduled)[2]
    assert meta.kv_group_tables is None and meta.for_kv_group(0) is meta
    eng.abort_request("x")
    assert eng.kv.num_used_blocks == 0


def test_the_cli_flag_turns_groups_off(swa_dirs):
    from pagedllm.commands.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", swa_dirs["gemma2"], "--disable-hybrid-kv-cache-manager"])
    assert engine_config(args).disable_hybrid_kv_cache_manager
    assert not engine_config(parser.parse_args(["--model", swa_dirs["gemma2"]])).disable_hybrid_kv_cache_manager


ASCEND_SIM = """
import json
import torch_npu
assert torch_npu.__pagedllm_simulation__, "not the simulated torch_npu"
from pagedllm import LLM, SamplingParams
prompts = [list(range(3, 303)), [7] * 40 + [11, 12]]
out = {}
for off in (False, True):
    llm = LLM(model=MODEL, device="ascend", dtype="float16", skip_tokenizer_init=True, max_model_len=512,
              max_num_seqs=4, enforce_eager=True, disable_hybrid_kv_cache_manager=off, max_num_batched_tokens=128)
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                       use_tqdm=False)
    kv = llm.llm_engine.kv
    out[str(off)] = dict(tokens=[list(o.outputs[0].token_ids) for o in res], used=kv.num_used_blocks,
                         freed=getattr(kv, "num_freed_by_window", None))
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_simulated_vendor_kernels_take_per_group_tables(swa_dirs, tmp_path):
    """The ascend plugin's own kernels (a simulated torch-npu, eager: its decode graphs hold one table) on Mistral's
    window with 128-token blocks: a 300-token prompt frees window blocks, and the tokens equal the one-table run."""
    sim = Path(__file__).resolve().parents[1] / "support" / "sim"
    (tmp_path / "cann").mkdir()
    env = dict(os.environ, PYTHONPATH=str(sim) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ASCEND_HOME_PATH=str(tmp_path / "cann"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", ASCEND_SIM.replace("MODEL", repr(swa_dirs["mistral"]))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-5000:]
    got = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert got["False"]["freed"] > 0 and got["True"]["freed"] is None
    assert got["False"]["tokens"] == got["True"]["tokens"]
    assert got["False"]["used"] == got["True"]["used"] == 0


def test_kv_memory_bench_reads_the_engines_blocks(swa_dirs):
    """``pagedllm bench kv-memory``'s measurement on the tiny Gemma 3 (2 sliding layers, window 8, 1 global): at 64
    tokens the full group holds 9 blocks, each sliding group the 2 its window reaches, one layer per block."""
    from pagedllm.bench.kv_memory import expected_ratio, measure

    one = measure(swa_dirs["gemma3"], 64, BS, "float32", "cpu", grouped=False, chunk=16)
    groups = measure(swa_dirs["gemma3"], 64, BS, "float32", "cpu", grouped=True, chunk=16)
    assert (one["blocks_steady"], groups["blocks_steady"]) == (9, 9 + 2 * 2)
    assert one["bytes_per_block"] == 3 * groups["bytes_per_block"]
    assert groups["mib_steady"] / one["mib_steady"] == pytest.approx(13 / 27)
    assert groups["freed_by_window"] > 0 and one["freed_by_window"] == 0
    config = hf_model(swa_dirs["gemma3"]).config.to_dict()
    assert expected_ratio(config, 64) == pytest.approx((1 + 2 * 8 / 64) / 3)


@pytest.mark.slow
def test_cpu_static_pads_every_groups_table_when_eager_and_keeps_one_under_its_graphs(swa_dirs):
    """cpu-static's bucket shapes: eager, the model runner pads each group's table and slots to the bucket (groups
    on); with its captured buckets, whose buffers hold one table, the engine keeps one table. Both equal HF."""
    path = swa_dirs["gemma2"]
    hf = hf_model(path)
    batch = prompts(hf.config.vocab_size)
    want = [hf_oracle.hf_greedy(hf, p, NEW) for p in batch]
    for eager in (True, False):
        llm = engine(path, device="cpu-static", enforce_eager=eager, max_num_seqs=4)
        assert isinstance(llm.llm_engine.kv, HybridKVCacheManager) == eager
        assert greedy(llm, batch) == want
        assert getattr(llm.llm_engine.kv, "num_freed_by_window", 0) > 0 or not eager
