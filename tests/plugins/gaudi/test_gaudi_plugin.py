"""The Gaudi plugin on this machine (no Gaudi stack): probe, discovery, config hook, bucket generation."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from pagedllm.backend.batch_policy import BatchShape
from pagedllm.config import EngineConfig, resolve_config
from pagedllm.backend.hookspec import ModelInfo
from pagedllm.errors import ParamError
from pagedllm_gaudi import bucketing, plugin

INFO = ModelInfo("LlamaForCausalLM", "float32", 2, 4, 2, 64, 512, 512)
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_USE_FAKE_HPU")}


def test_loading_the_plugin_imports_nothing_vendor_and_the_probe_says_why():
    code = ("import sys, pagedllm_gaudi.plugin as p; r = p.pagedllm_probe(); "
            "assert not any(m.startswith('habana') for m in sys.modules), sorted(sys.modules); "
            "print(r.usable, r.reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CLEAN_ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("False habana_frameworks not installed (Intel Gaudi software stack; "
                                  "see docs/backends/gaudi.md)")


def test_pagedllm_backends_lists_gaudi_with_its_reason_and_torch_still_imports():
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends"], capture_output=True, text=True,
                         env=CLEAN_ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("gaudi "))
    assert "pagedllm-gaudi" in line and "habana_frameworks not installed" in line, line
    assert subprocess.run([sys.executable, "-c", "import torch; torch.ones(1)"], env=CLEAN_ENV,
                          timeout=120).returncode == 0


def test_config_hook_gives_block_size_128_and_bf16():
    class Stub:  # resolve_config's view of a backend: the plugin's own hooks
        name = "gaudi"
        capabilities = plugin.pagedllm_capabilities()
        update_config = staticmethod(plugin.pagedllm_update_config)

    resolved = resolve_config(EngineConfig(model="m"), Stub(), INFO)
    assert (resolved.block_size, resolved.dtype) == (128, "bfloat16")
    resolved = resolve_config(EngineConfig(model="m", dtype="float32", block_size=128), Stub(), INFO)
    assert (resolved.block_size, resolved.dtype) == (128, "float32")


@pytest.mark.parametrize("overrides,field,words", [
    (dict(block_size=16), "block_size", "128-token blocks only"),
    (dict(dtype="float16"), "dtype", "float16 is not supported"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype", "model dtype only"),
])
def test_config_hook_refuses_with_reasons(overrides, field, words):
    with pytest.raises(ParamError, match=words) as e:
        plugin.pagedllm_update_config(EngineConfig(model="m", **overrides), INFO)
    assert e.value.field == field
    with pytest.raises(ParamError, match="gguf checkpoints"):
        plugin.pagedllm_update_config(EngineConfig(model="m"), ModelInfo("LlamaForCausalLM", "float32", 2, 4, 2, 64,
                                                                        512, 512, quantization="gguf"))


def test_identity_and_collectives():
    assert plugin.pagedllm_distributed_backend() == "hccl"
    info = plugin.pagedllm_backend_info()
    assert (info.name, info.device_type, info.extra) == ("gaudi", "hpu", "gaudi")
    caps = plugin.pagedllm_capabilities()
    assert caps.block_sizes == (128,) and caps.dtypes[0] == "bfloat16" and caps.on_device_sampling


def test_vllm_gaudi_bucket_ranges():
    # The docstring examples of vllm_gaudi/extension/bucketing/linear.py and exponential.py.
    assert bucketing.warmup_range(2, 32, 64) == [2, 4, 8, 16, 32, 64]
    assert bucketing.warmup_range_with_limit(128, 128, 2048, 10) == [128, 256, 384, 512, 640, 896, 1152, 1536, 2048]
    assert bucketing.warmup_range_with_limit(1, 2, 4, 3) == [1, 2, 4]


def test_bucket_env_knobs(monkeypatch):
    monkeypatch.setenv("VLLM_BUCKETING_STRATEGY", "lin")
    monkeypatch.setenv("VLLM_DECODE_BS_BUCKET_STEP", "4")
    tokens, seqs, width = bucketing.bucket_ranges(16, 512, 2048, 128)
    assert seqs == (1, 2, 4, 8, 12, 16)
    assert width == (1, 2, 4, 8, 12, 16)
    assert tokens == tuple(sorted({1, 2, 4, 8, 12, 16, 128, 256, 384, 512}))
    monkeypatch.setenv("VLLM_BUCKETING_STRATEGY", "pad")
    with pytest.raises(ValueError, match="VLLM_BUCKETING_STRATEGY"):
        bucketing.bucket_ranges(16, 512, 2048, 128)


@pytest.mark.parametrize("strategy", ["exp", "lin"])
def test_every_real_step_pads_into_the_warmup_set(monkeypatch, strategy):
    monkeypatch.setenv("VLLM_BUCKETING_STRATEGY", strategy)
    tokens, seqs, width = bucketing.bucket_ranges(8, 256, 1024, 128)
    from pagedllm.backend.batch_policy import BucketPolicy

    policy = BucketPolicy(tokens, seqs, width, block_size=128)
    assert policy.limits() == BatchShape(256, 8, 8)
    warm = set(policy.warmup_shapes())
    for t, s, w in itertools.product(range(1, 257), range(1, 9), range(1, 9)):
        if s <= t <= s * w * 128:
            assert policy.pad(BatchShape(t, s, w)) in warm, (t, s, w)
