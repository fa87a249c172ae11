"""Per-layer KV-connector calls (issue 31): on an eager step each attention layer waits for its own loads right
before it reads its cache and hands its cache to ``save_kv_layer`` right after it wrote it (vLLM's
``wait_for_kv_layer_from_connector`` / ``maybe_save_kv_layer_to_connector``), the offloading connector's host hits
land layer by layer, and a load error found at a later layer ends in a recompute with the same greedy tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.kv_transfer import ENTRY_POINT_GROUP
from pagedllm.kv_transfer.offloading import OffloadingConnector, OffloadMetadata

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 64 * 4  # tiny llama: layers x K/V x tokens x kv heads x head size x float32
SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = toks(1, 10 * BS)
WORKLOAD = [PREFIX + toks(3, 5), toks(2, 170), PREFIX + toks(4, 7)]  # the filler evicts the prefix's last blocks


@dataclass
class StepMeta(OffloadMetadata):
    new_slots: list[int] = field(default_factory=list)  # flat cache slots this step's forward writes


class LayerwiseRecorder(OffloadingConnector):
    """The offloading connector, recording every worker-side call with what each layer's new-token slots held at
    that moment (zeroed before the forward: nonzero means the layer has written them)."""

    def build_connector_meta(self, scheduler_output):
        base = super().build_connector_meta(scheduler_output)
        bs, slots = self.context.block_size, []
        for s in scheduler_output.scheduled:
            ids = self.context.block_ids(s.request.request_id)
            slots += [ids[p // bs] * bs + p % bs for p in range(s.num_computed_tokens,
                                                                 s.num_computed_tokens + s.num_new_tokens)]
        return StepMeta(base.saves, base.loads, slots)

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self.registered, self.events = dict(kv_caches), []

    def _written(self) -> list[bool]:
        slots = torch.tensor(self.get_connector_metadata().new_slots)
        return [bool(c[:, slots // BS, slots % BS].abs().sum() > 0) for c in self.registered.values()]

    def start_load_kv(self, **kwargs):
        slots = torch.tensor(self.get_connector_metadata().new_slots)
        for c in self.registered.values():
            c[:, slots // BS, slots % BS] = 0
        self.events.append(("start", None, None))
        super().start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer_name):
        self.events.append(("wait", layer_name, self._written()))
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        assert kv_layer is self.registered[layer_name]
        assert isinstance(attn_metadata, AttentionMetadata)
        got = attn_metadata.slot_mapping[attn_metadata.slot_mapping >= 0].tolist()
        assert sorted(got) == sorted(self.get_connector_metadata().new_slots)
        self.events.append(("save", layer_name, self._written()))

    def wait_for_save(self):
        self.events.append(("wait_for_save", None, None))


class MiddleLayerFault(OffloadingConnector):
    """Host hits that land for the first layer but are found broken at the last (middle of the model's read path):
    that layer's and later layers' loaded blocks are garbage and reported as load errors."""

    def wait_for_layer_load(self, layer_name):
        super().wait_for_layer_load(layer_name)
        layers = list(self.layer_index)
        k = len(layers) // 2
        if layer_name == layers[k] and self.host_loads:
            targets = [dst for _, dst in self.host_loads]
            for c in self.device_caches[k:]:
                c[:, targets] = 3.0
            self.load_errors.update(targets)
            self.faults = getattr(self, "faults", 0) + 1


@pytest.fixture
def test_connectors(tmp_path, monkeypatch):
    """This module's connectors under the connector entry points, as a third-party package registers them."""
    dist = tmp_path / "layerwise_test_connectors-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: layerwise-test-connectors\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n"
                                           f"LayerwiseRecorder = {__name__}:LayerwiseRecorder\n"
                                           f"MiddleLayerFault = {__name__}:MiddleLayerFault\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def engine(path: str, device: str = "cpu", **kw) -> LLM:
    return LLM(path, device=device, dtype="float32", max_model_len=256, num_gpu_blocks_override=16, **kw)


def run_each(llm: LLM) -> list[list[int]]:
    out = []
    for p in WORKLOAD:
        out.append(llm.generate([{"prompt_token_ids": p}], SP, use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.llm_engine.kv.num_used_blocks == 0 and not llm.llm_engine.kv.pending_load
    return out


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    return run_each(engine(tiny_llama))


def test_each_layer_waits_before_its_read_and_saves_after_its_write(tiny_llama, baseline, test_connectors):
    llm = engine(tiny_llama, kv_transfer_config={"kv_connector": "LayerwiseRecorder", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 5 * BLOCK_BYTES}})
    rt = llm.llm_engine.kv_transfer
    assert run_each(llm) == baseline
    assert rt.layerwise is llm.llm_engine.worker.runner  # eager on the CPU backend: per-layer calls
    w = rt.worker_side
    names = list(w.registered)
    assert names == rt.layer_names == [f"model.layers.{i}.self_attn" for i in range(len(names))]
    steps, cur = [], None
    for kind, name, written in w.events:
        if kind == "start":
            cur = []
        elif kind == "wait_for_save":
            steps.append(cur)
        else:
            cur.append((kind, name, written))
    assert len(steps) > len(WORKLOAD)  # every step with a forward, decodes included
    n = len(names)
    for calls in steps:
        assert [(k, nm) for k, nm, _ in calls] == [(k, nm) for nm in names for k in ("wait", "save")]
        for i in range(n):  # at layer i's wait layers < i have run; at its save layer i has too, later ones not
            assert calls[2 * i][2] == [j < i for j in range(n)], calls
            assert calls[2 * i + 1][2] == [j <= i for j in range(n)], calls
    st = llm.llm_engine.get_stats().kv_offload
    assert st["host_hits"] == 5 and st["load_errors"] == 0 and st["recomputes"] == 0


def test_load_error_found_at_a_later_layer_is_recomputed_with_the_same_tokens(tiny_llama, baseline,
                                                                               test_connectors):
    llm = engine(tiny_llama, kv_transfer_config={"kv_connector": "MiddleLayerFault", "kv_connector_extra_config": {
        "cpu_bytes_to_use": 5 * BLOCK_BYTES}})
    assert run_each(llm) == baseline
    rt = llm.llm_engine.kv_transfer
    assert rt.layerwise is llm.llm_engine.worker.runner and rt.worker_side.faults == 1
    st = llm.llm_engine.get_stats().kv_offload
    assert st["recomputes"] == 1 and st["load_errors"] == 5
    assert llm.llm_engine.kv.pool.cached  # the recomputed blocks are published again; the failed ones were dropped


def test_static_buckets_keep_the_whole_model_calls_with_one_log_line(tiny_llama, baseline, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.kv_transfer.runtime"):
        llm = engine(tiny_llama, "cpu-static", kv_offload_gib=5 * BLOCK_BYTES / 2**30, max_num_seqs=2,
                     max_num_batched_tokens=64)  # few buckets to warm up
        assert run_each(llm) == baseline
    assert llm.llm_engine.kv_transfer.layerwise is False
    lines = [r.message for r in caplog.records if "not per layer" in r.message]
    assert len(lines) == 1 and "captured graphs" in lines[0], lines
    assert llm.llm_engine.get_stats().kv_offload["host_hits"] == 5
