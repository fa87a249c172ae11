"""KV beyond the device pool (issue 31, docs/kv-offload.md): the host and disk tiers under the prefix cache give the
same greedy tokens as recomputing, a second engine process finds what the first wrote, damaged files are misses,
the tiers keep their bounds, nothing leaks, and connectors (built-in and a third party's, through its entry point)
pass the connector conformance check."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import engine_parity
from pagedllm import LLM, SamplingParams
from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.engine.llm_engine import EngineStats
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.errors import ParamError
from pagedllm.kv_transfer import ENTRY_POINT_GROUP, KVTransferConfig
from pagedllm.kv_transfer import disk_store
from pagedllm.kv_transfer.conformance import check_connector
from pagedllm.kv_transfer.disk_store import DiskStore
from pagedllm.sched.kv_manager import hash_block

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 64 * 4  # tiny llama: layers x K/V x tokens x kv heads x head size x float32
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = toks(1, 10 * BS)  # 10 full blocks
FILLER = toks(2, 170)  # with the pool's 6 never-used blocks, evicts the prefix's last 5 blocks (P9..P5)
WORKLOAD = [PREFIX + toks(3, 5), FILLER, PREFIX + toks(4, 7)]


def engine(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=16, **kw)


def run_each(llm: LLM, prompts) -> list[list[int]]:
    """One request at a time (the order decides what is evicted); every block back in the pool after each (the
    engine loop steps while a connector still holds a finished request's blocks, as the server's does)."""
    out = []
    for p in prompts:
        out.append(llm.generate([{"prompt_token_ids": p}], SP, use_tqdm=False)[0].outputs[0].token_ids)
        eng = llm.llm_engine
        while eng.has_unfinished_requests():  # a connector may keep a finished request's blocks a step longer
            eng.step()
        assert eng.kv.num_used_blocks == 0 and not eng.kv.pending_load and not eng.has_unfinished_requests()
        st = eng.get_stats().kv_offload
        assert st.get("pending_loads", 0) == 0 and st.get("delayed_frees", 0) == 0
    return out


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    llm = engine(tiny_llama)
    out = run_each(llm, WORKLOAD)
    assert llm.llm_engine.stats.prefix_hits > 0  # P0..P4 stay on the device
    assert out[2] == engine_parity.hf_greedy(tiny_llama, WORKLOAD[2], 4)
    return out


def test_prefix_served_from_device_host_and_disk_is_exact(tiny_llama, baseline, tmp_path):
    # Host holds 3 blocks: of P9..P5, P9 and P8 move down to disk; the last request gets P0..P4 from the device,
    # P5..P7 from host, P8..P9 from disk.
    llm = engine(tiny_llama, kv_offload_gib=3 * BLOCK_BYTES / 2**30, kv_offload_dir=str(tmp_path))
    eng = llm.llm_engine
    got = run_each(llm, WORKLOAD[:2])
    hits_before = eng.stats.prefix_hits
    got += run_each(llm, WORKLOAD[2:])
    st = eng.get_stats().kv_offload
    assert got == baseline
    assert eng.stats.prefix_hits - hits_before == 5 * BS  # device: P0..P4
    assert st["host_hits"] == 3 and st["disk_hits"] == 2, st
    assert st["host_blocks"] <= st["host_capacity_blocks"] == 3
    assert st["load_errors"] == 0 and st["host_bytes_loaded"] == st["host_hits"] * BLOCK_BYTES


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_each_tier_alone_is_exact(tiny_llama, baseline, tmp_path, tiers):
    kw = {"kv_offload_gib": 0.01} if tiers == "host" else {"kv_offload_dir": str(tmp_path)}
    llm = engine(tiny_llama, **kw)
    assert run_each(llm, WORKLOAD) == baseline
    st = llm.llm_engine.get_stats().kv_offload
    assert st[f"{tiers}_hits"] == 5 and st["load_errors"] == 0, st
    assert st["host_blocks"] <= st["host_capacity_blocks"]


def test_host_tier_never_exceeds_its_bound(tiny_llama, baseline):
    llm = engine(tiny_llama, kv_offload_gib=2 * BLOCK_BYTES / 2**30)
    eng = llm.llm_engine
    assert eng.kv_transfer.worker_side.host_caches[0].shape[1] == 2  # what was allocated
    for i, p in enumerate(WORKLOAD + [toks(5, 200), PREFIX + toks(6, 3)]):
        eng.add_request(str(i), {"prompt_token_ids": p}, SP)
        while eng.has_unfinished_requests():
            eng.step()
            sched_side = eng.kv_transfer.scheduler_side
            assert len(sched_side.host) <= 2 and len(sched_side.free_slots) + len(sched_side.host) == 2
    assert eng.kv.num_used_blocks == 0 and eng.get_stats().kv_offload["host_hits"] > 0
    worker_side = eng.kv_transfer.worker_side
    llm.shutdown()
    assert worker_side.host_caches == [] and worker_side.device_caches == []  # host memory released


SECOND_ENGINE = textwrap.dedent("""
    import json, sys
    from pagedllm import LLM, SamplingParams
    path, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=16,
              kv_offload_dir=disk)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    print(json.dumps({"tokens": out, "stats": llm.llm_engine.get_stats().kv_offload}))
""")


def test_second_engine_process_finds_what_the_first_wrote(tiny_llama, baseline, tmp_path):
    first = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    run_each(first, WORKLOAD[:2] + [toks(7, 100)])  # P9..P5, then P4..P0 (and one filler block) evicted to disk
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 11 and all(f.endswith(".kvb") for f in files)  # whole files only: no temporary left
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", SECOND_ENGINE, tiny_llama, str(tmp_path), json.dumps(WORKLOAD[2])],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["tokens"] == baseline[2]
    assert got["stats"]["disk_hits"] == 10 and got["stats"]["load_errors"] == 0, got["stats"]  # the whole prefix


def test_corrupted_and_truncated_files_are_misses_never_loaded(tiny_llama, baseline, tmp_path):
    first = engine(tiny_llama, kv_offload_dir=str(tmp_path))
    run_each(first, WORKLOAD[:2])
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs)
    store = first.llm_engine.kv_transfer.worker_side.disk
    hashes = [None]
    for i in range(10):
        hashes.append(hash_block(hashes[-1], PREFIX[i * BS:(i + 1) * BS]))
    hashes = hashes[1:]
    p5, p7 = store.path(hashes[5]), store.path(hashes[7])
    assert p5 in paths and p7 in paths
    with open(p7, "r+b") as f:  # one flipped payload byte
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(p5, "r+b") as f:  # truncated
        f.truncate(os.path.getsize(p5) - 100)
    assert run_each(first, WORKLOAD[2:]) == baseline[2:]
    st = first.llm_engine.get_stats().kv_offload
    assert st["load_errors"] >= 1 and st["recomputes"] == 1 and st["disk_hits"] == 0, st
    assert not os.path.exists(p5)  # the first bad file ends the load: deleted, recomputed from P5
    # the second is found bad as soon as it is read
    assert store.read(hashes[7], PREFIX[7 * BS:8 * BS], first.llm_engine.kv_transfer.worker_side.staging) == 0
    assert not os.path.exists(p7)


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_bound_deletes_least_recently_used_and_zero_or_full_disk_turn_the_tier_off(tmp_path, caplog,
                                                                                         monkeypatch):
    t = [torch.arange(64, dtype=torch.float32).view(2, 1, 4, 8)]
    size = None
    store = DiskStore(str(tmp_path / "a"), "model-x", max_bytes=3 * 400)
    for i in range(6):
        h = bytes([i]) * 32
        n = store.write(h, [i] * 4, t)
        size = size or n
        assert n > 0
        out = [torch.zeros_like(t[0])]
        assert store.read(h, [i] * 4, out) == n and torch.equal(out[0], t[0])
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "a") for f in fs)
    assert on_disk <= 3 * 400 and store.contains(bytes([5]) * 32) and not store.contains(bytes([0]) * 32)
    assert not store.read(bytes([5]) * 32, [9] * 4, [torch.zeros_like(t[0])])  # other tokens: a miss
    with caplog.at_level(logging.WARNING):
        assert not DiskStore(str(tmp_path / "b"), "m", max_bytes=0).enabled
        full = DiskStore(str(tmp_path / "c"), "m", max_bytes=1 << 20)
        # the store's open() fails as on a full file system (which a test cannot fill safely)
        monkeypatch.setattr(disk_store, "open", enospc, raising=False)
        assert full.write(b"\x01" * 32, [1] * 4, t) == 0
        assert full.write(b"\x02" * 32, [1] * 4, t) == 0
    assert not full.enabled and not full.contains(b"\x01" * 32)
    warnings = [r.message for r in caplog.records if "disk tier off" in r.message]
    assert len(warnings) == 2 and "0 bytes" in warnings[0] and "ENOSPC" in warnings[1]
    assert not [f for _, _, fs in os.walk(tmp_path / "c") for f in fs]  # no temporary left behind


@pytest.mark.parametrize("why", ["ENOSPC", "bound of 0"])
def test_full_disk_or_zero_bound_degrades_to_no_disk_tier_with_identical_outputs(tiny_llama, baseline, tmp_path,
                                                                                  caplog, monkeypatch, why):
    if why == "ENOSPC":
        monkeypatch.setattr(disk_store, "open", enospc, raising=False)
    with caplog.at_level(logging.WARNING):
        llm = engine(tiny_llama, kv_offload_gib=2 * BLOCK_BYTES / 2**30, kv_offload_dir=str(tmp_path),
                     kv_offload_disk_gib=0 if why != "ENOSPC" else 1)
        assert run_each(llm, WORKLOAD) == baseline
    st = llm.llm_engine.get_stats().kv_offload
    assert st["disk_hits"] == 0 and st["host_hits"] == 2 and st["load_errors"] == 0
    assert len([r for r in caplog.records if "disk tier off" in r.message]) == 1


def test_offload_config_surface(tiny_llama, tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--kv-offload-gib", "0.5", "--kv-offload-dir", str(tmp_path)]))
    assert cfg.kv_transfer_config == KVTransferConfig("OffloadingConnector", "kv_both", {
        "cpu_bytes_to_use": 1 << 29, "disk_path": str(tmp_path), "disk_bytes_to_use": 16 << 30})
    cfg = engine_config(p.parse_args(["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", '
                                      '"kv_connector_extra_config": {"cpu_bytes_to_use": 1024}}']))
    assert cfg.kv_transfer_config.kv_connector_extra_config == {"cpu_bytes_to_use": 1024}
    for kw, field in (({"kv_transfer_config": {"kv_connector": "x", "role": 1}}, "kv_transfer_config.role"),
                      ({"kv_transfer_config": {"kv_connector": "x", "kv_role": "both"}}, "kv_transfer_config.kv_role"),
                      ({"kv_transfer_config": "{nope"}, "kv_transfer_config"),
                      ({"kv_offload_gib": -1}, "kv_offload_gib"),
                      ({"kv_offload_gib": 1, "kv_transfer_config": {"kv_connector": "Other"}}, "kv_offload_gib"),
                      ({"kv_transfer_config": {"kv_connector": "NoSuchConnector"}}, "kv_transfer_config.kv_connector"),
                      ({"kv_offload_gib": 1, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                       "kv_offload_gib"),
                      ({"kv_offload_gib": 1, "enable_prefix_caching": False}, "kv_offload_gib")):
        with pytest.raises(ParamError) as e:
            engine(tiny_llama, **kw)
        assert e.value.field == field, (kw, e.value)


def test_kv_offload_metrics_render():
    st = EngineStats(kv_offload={"host_hits": 3, "disk_hits": 2, "disk_bytes_loaded": 100, "host_blocks": 4,
                                 "load_errors": 1, "recomputes": 1})
    text = ServerMetrics(lambda: [(st, 0)], "m").render().decode()
    assert 'pagedllm:kv_offload_hits_total{engine="0",model_name="m",tier="host"} 3.0' in text
    assert 'pagedllm:kv_offload_hits_total{engine="0",model_name="m",tier="disk"} 2.0' in text
    assert 'pagedllm:kv_offload_bytes_loaded_total{engine="0",model_name="m",tier="disk"} 100.0' in text
    assert 'pagedllm:kv_offload_host_blocks{engine="0",model_name="m"} 4.0' in text
    assert 'pagedllm:kv_offload_recomputes_total{engine="0",model_name="m"} 1.0' in text
    assert "kv_offload" not in ServerMetrics(lambda: [(EngineStats(), 0)], "m").render().decode()


@pytest.fixture
def third_party_connector(tmp_path, monkeypatch):
    """A distribution registering tests/support/kv_connector_example.py under the connector entry points."""
    dist = tmp_path / "example_kv_connector-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-kv-connector\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n"
                                           "ExampleStoreConnector = kv_connector_example:ExampleStoreConnector\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "ExampleStoreConnector"


def test_third_party_connector_through_its_entry_point(tiny_llama, baseline, third_party_connector):
    report = check_connector(third_party_connector)
    assert report.loaded_tokens > 0 and report.recomputed_requests > 0 and len(report.checks) == 6, report
    llm = engine(tiny_llama, kv_transfer_config={"kv_connector": third_party_connector})
    assert run_each(llm, WORKLOAD) == baseline
    assert llm.llm_engine.get_stats().kv_offload["stored_blocks"] > 0


@pytest.mark.parametrize("extra", [{"cpu_bytes_to_use": 4 * 1024},  # (1 KiB blocks there)
                                   {"cpu_bytes_to_use": 1024, "disk_path": "{tmp}/d", "disk_bytes_to_use": 1 << 20},
                                   {"disk_path": "{tmp}/d", "disk_bytes_to_use": 1 << 20}])
def test_offloading_connector_conformance(extra):
    report = check_connector("OffloadingConnector", extra)
    assert report.loaded_tokens > 0 and report.recomputed_requests > 0, report


def test_a_model_with_recurrent_state_refuses_a_connector(tmp_path):
    from tiny_models import save_random_model
    path = save_random_model(dict(model_type="lfm2", vocab_size=128, hidden_size=48, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=128, norm_eps=1e-5, conv_L_cache=3, conv_bias=True,
                                  block_multiple_of=32, layer_types=["conv", "full_attention"],
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                             tmp_path / "lfm2")
    with pytest.raises(ParamError, match="recurrent state") as e:
        LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_offload_gib=0.01)
    assert e.value.field == "kv_offload_gib"
