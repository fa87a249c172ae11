"""The TPU plugin's packaging, discovery, probe, config hook and batch policy (fast; no model runs).

This machine has no TPU: the probe must say so ("no TPU: jax sees only cpu") without breaking anything, and only the
explicit ``PAGEDLLM_TPU_PLATFORM=cpu`` opt-in makes the backend usable, on JAX's XLA CPU device, labelled as such.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedllm.backend.batch_policy import BatchShape
from pagedllm.backend.hookspec import ModelInfo

ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_TPU_")}


def _run(code: str, env: dict | None = None) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**ENV, **(env or {})})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.fixture
def platform_env(monkeypatch):
    """Set PAGEDLLM_TPU_PLATFORM for one test (device choice is cached per process: cleared around it)."""
    from pagedllm_tpu import platform

    def set_platform(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(platform.PLATFORM_ENV, raising=False)
        else:
            monkeypatch.setenv(platform.PLATFORM_ENV, value)
        platform.device.cache_clear()

    yield set_platform
    platform.device.cache_clear()


def test_distribution_entry_point_and_core_pin():
    eps = {ep.name: ep for ep in md.entry_points(group="pagedllm.backends")}
    assert eps["tpu"].value == "pagedllm_tpu.plugin" and eps["tpu"].dist.name == "pagedllm-tpu"
    dist = md.distribution("pagedllm-tpu")
    assert dist.version == "0.2.0"
    reqs = dist.requires or []
    assert "pagedllm<0.3,>=0.2" in reqs, reqs
    assert any(r.startswith("jax[cpu]") for r in reqs), reqs  # jax + jaxlib; the tpu extra adds libtpu


def test_importing_and_probing_the_plugin_imports_no_jax():
    """Discovery is cheap: neither the import nor, without libtpu, the probe loads jax."""
    out = _run("import sys, pagedllm_tpu.plugin, pagedllm_tpu.runner; pagedllm_tpu.plugin.pagedllm_probe(); "
               "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    assert out.strip() == "[]"


def test_pagedllm_backends_lists_tpu_with_the_reason_and_torch_still_imports():
    out = _run("import sys, torch; from pagedllm.cli import main; sys.argv = ['pagedllm', 'backends']; main()")
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["tpu"])
    rest = [ln.strip() for ln in lines[at + 1:]]
    line = " ".join([lines[at]] + rest[:next((i for i, ln in enumerate(lines[at + 1:]) if not ln.startswith(" ")),
                                             len(rest))])  # the row's reason may wrap under its column
    assert " no " in line and "no TPU: libtpu is not installed, so jax" in line and "sees only cpu" in line, line
    out = _run("import pagedllm_tpu.plugin, torch; print(torch.ones(2).sum().item())")
    assert out.strip() == "2.0"


def test_probe_reasons(platform_env, monkeypatch):
    import jax

    from pagedllm_tpu import platform, plugin

    platform_env(None)
    p = plugin.pagedllm_probe()
    assert not p.usable and p.reason == f"no TPU: libtpu is not installed, so jax {jax.__version__} sees only cpu"
    # With libtpu present (simulated: its spec is faked, nothing of it runs) jax itself is asked, and here it finds
    # only the CPU.
    real = platform.importlib.util.find_spec
    monkeypatch.setattr(platform.importlib.util, "find_spec",
                        lambda name: real("jax") if name == "libtpu" else real(name))
    p = plugin.pagedllm_probe()
    assert not p.usable and p.reason == f"no TPU: jax {jax.__version__} sees only cpu"
    monkeypatch.setattr(platform.importlib.util, "find_spec", real)
    platform_env("gpu")
    assert "expected 'tpu' or 'cpu'" in plugin.pagedllm_probe().reason
    platform_env("cpu")
    p = plugin.pagedllm_probe()
    assert p.usable and "XLA CPU" in p.device_name and platform.CPU_LABEL in p.device_name
    monkeypatch.setattr(platform.importlib.util, "find_spec", lambda name: None)  # jax absent
    p = plugin.pagedllm_probe()
    assert not p.usable and p.reason.startswith("jax/jaxlib not installed")


def test_batch_policy_is_bounded_by_token_and_sequence_buckets():
    from pagedllm_tpu import plugin

    ctx = SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, block_size=16)
    policy = plugin.pagedllm_batch_policy(ctx)
    assert policy.token_buckets == (16, 32, 64) and policy.seq_buckets == (8,) and policy.block_buckets == (8,)
    assert policy.warmup_shapes() == [BatchShape(16, 8, 8), BatchShape(32, 8, 8), BatchShape(64, 8, 8)]
    big = plugin.pagedllm_batch_policy(SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=256,
                                                       max_model_len=4096, block_size=16))
    assert big.token_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert big.seq_buckets == (8, 16, 32, 64, 128, 256) and big.block_buckets == (256,)
    # A (tokens, seqs) pair is compiled only when some real step pads to it: at least as many tokens as sequences.
    assert len(big.warmup_shapes()) == sum(1 for t in big.token_buckets for j, s in enumerate(big.seq_buckets)
                                           if t >= (big.seq_buckets[j - 1] + 1 if j else 1))


def _info(dtype: str) -> ModelInfo:
    return ModelInfo("LlamaForCausalLM", dtype, 2, 4, 2, 64, 512, 512)


def test_update_config_and_memory_info(platform_env, monkeypatch, tiny_llama):
    from pagedllm_tpu import platform, plugin

    platform_env("cpu")
    cfg = SimpleNamespace(dtype="auto", model=tiny_llama)
    assert plugin.pagedllm_update_config(cfg, _info("float32")) == {"dtype": "float32"}  # exact parity on XLA CPU
    assert plugin.pagedllm_update_config(SimpleNamespace(dtype="float32", model=tiny_llama), _info("float32")) is None
    mi = plugin.pagedllm_memory_info(None)
    assert 0 < mi.free_bytes <= mi.total_bytes and mi.default_kv_bytes <= 4 << 30
    # The TPU branch of the glue (simulated: this machine has no TPU, so on_tpu and the HBM numbers are stand-ins):
    # bf16 for "auto", and the weights the runner will place are kept out of the KV budget.
    monkeypatch.setattr(platform, "on_tpu", lambda: True)
    monkeypatch.setattr(platform, "memory_stats", lambda: (16 << 30, 15 << 30))
    assert plugin.pagedllm_update_config(cfg, _info("float32")) == {"dtype": "bfloat16"}
    weights = sum(os.path.getsize(os.path.join(tiny_llama, f)) for f in os.listdir(tiny_llama)
                  if f.endswith(".safetensors")) // 2
    mi = plugin.pagedllm_memory_info(None)
    assert mi.total_bytes == 16 << 30 and mi.free_bytes == (15 << 30) - weights and mi.default_kv_bytes is None


def test_tensor_parallel_size_must_divide_the_heads(platform_env, monkeypatch, tiny_llama):
    from pagedllm.errors import ParamError
    from pagedllm_tpu import mesh, plugin

    platform_env("cpu")
    monkeypatch.setenv(mesh.TP_ENV, "4")
    with pytest.raises(ParamError, match="PAGEDLLM_TPU_TP=4 must divide the attention heads"):
        plugin.pagedllm_update_config(SimpleNamespace(dtype="float32", model=tiny_llama), _info("float32"))
    monkeypatch.setenv(mesh.TP_ENV, "2")
    assert plugin.pagedllm_update_config(SimpleNamespace(dtype="float32", model=tiny_llama), _info("float32")) is None


def test_compilation_cache_is_configured_from_the_environment(monkeypatch, tmp_path, platform_env):
    import jax

    from pagedllm_tpu import platform

    platform_env("cpu")
    monkeypatch.delenv(platform.CACHE_DIR_ENV, raising=False)
    assert platform.cache_dir() is None  # XLA CPU: off unless asked; a TPU defaults to ~/.cache/pagedllm/xla
    monkeypatch.setenv(platform.CACHE_DIR_ENV, str(tmp_path / "xla"))
    monkeypatch.setenv(platform.DISABLE_CACHE_ENV, "1")
    assert platform.cache_dir() is None
    monkeypatch.delenv(platform.DISABLE_CACHE_ENV)
    old = jax.config.jax_compilation_cache_dir
    try:
        assert platform.enable_compilation_cache() == str(tmp_path / "xla")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
