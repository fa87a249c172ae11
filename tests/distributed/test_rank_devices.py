"""Per-rank device selection on a SIMULATED multi-device accelerator (tests/support/sim/multidev: wrapper tensors on CPU
that carry a device index; not verified on hardware). Each rank of a tensor-parallel engine and each data-parallel
replica must call ``pagedllm_set_device(torch.device(type, local index))`` and hold its weights and KV pool there; the
CPU backend keeps its one device. Each simulated run is a subprocess (the device rename is once per process) with the
simulated backend registered as an entry point."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import torch

from dist_utils import engine, make_dist_model
from pagedllm.backend.registry import get_backend
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.distributed.binding import local_device, local_index

# Not tests/support/sim itself: transformers imports the torch_npu it would find there.
SIM = str(Path(__file__).resolve().parents[1] / "support" / "sim" / "multidev")

PROBE = """
import json, logging, torch, simdev
logging.basicConfig(level=logging.INFO)
from pagedllm import LLM, SamplingParams
llm = LLM(MODEL, device="simdev", dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
          skip_tokenizer_init=True, enable_prefix_caching=True, **KW)
eng = llm.llm_engine
out = llm.generate([{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 6, 7]}],
                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
weights = {str(p.device) for p in eng.model.parameters()}
kv = {str(t.device) for c in eng.kv_caches for t in (c if isinstance(c, (list, tuple)) else [c])}
ex = eng.executor
print("RESULT", json.dumps(dict(device=str(eng.device), set_device=simdev.SET_DEVICE_CALLS, weights=sorted(weights),
                                kv=sorted(kv), tokens=[list(o.outputs[0].token_ids) for o in out])))
if ex is not None:
    eng.shutdown()
"""


def run_sim(tmp_path: Path, model: str, **kw) -> dict:
    """PROBE in a subprocess with tests/support/sim/multidev on PYTHONPATH and the simdev backend registered (a
    dist-info folder)."""
    reg = tmp_path / "reg"
    info = reg / "pagedllm_simdev-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedllm-simdev\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[pagedllm.backends]\nsimdev = simdev.plugin\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SIM, str(reg), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    code = PROBE.replace("MODEL", repr(model)).replace("KW", repr(kw))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return dict(json.loads(res.stdout.split("RESULT ", 1)[1]), log=res.stderr)


def test_cpu_ranks_keep_the_one_device():
    cpu = get_backend("cpu")
    assert [local_device(cpu, i) for i in range(3)] == [torch.device("cpu")] * 3
    cfg = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_rank=1)
    assert [local_index(cfg, r) for r in range(4)] == [4, 5, 6, 7]  # replica 1's ranks follow replica 0's four


def test_replica_and_ranks_select_their_simulated_device(tmp_path):
    model = make_dist_model("llama", tmp_path / "models")
    want = engine(model).generate([{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 6, 7]}],
                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    want = [list(o.outputs[0].token_ids) for o in want]
    one = run_sim(tmp_path, model)  # a lone engine: replica 0's device
    assert one["device"] == "simdev:0" and one["set_device"] == [0]
    assert one["weights"] == ["simdev:0"] and one["kv"] == ["simdev:0"] and one["tokens"] == want
    replica = run_sim(tmp_path, model, data_parallel_rank=1)  # what the DP server gives replica 1
    assert replica["device"] == "simdev:1" and set(replica["set_device"]) == {1}
    assert replica["weights"] == ["simdev:1"] and replica["kv"] == ["simdev:1"] and replica["tokens"] == want

    tp = run_sim(tmp_path, model, tensor_parallel_size=2, data_parallel_rank=1)  # replica 1 of a TP=2 server
    assert tp["device"] == "simdev:2" and set(tp["set_device"]) == {2}  # rank 0, in this process
    assert tp["weights"] == ["simdev:2"] and tp["kv"] == ["simdev:2"] and tp["tokens"] == want
    # Rank 1 (the worker process) on simdev:3: had its weights or KV been elsewhere, the simulated device would have
    # refused the first op mixing indices (the step's tensors move to the rank's device).
    assert re.search(r"rank 1 \(tp 1, pp 0\) on simdev:3", tp["log"]), tp["log"][-3000:]
