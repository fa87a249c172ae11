"""Capability refusal for models with recurrent state (issue 28): ``Capabilities.state_ops`` / ``state_dtypes``
against ``ModelInfo.state``. A simulated backend that declares fewer state-op families or state dtypes than a hybrid
checkpoint needs refuses it at start-up (before any weight is read), naming the layer type and the backend; what it
does declare runs, with the reference backend's tokens; a backend that states nothing (every v2 plugin, the built-in
ones) keeps running them all. ``ModelInfo.state`` says what each family's loaded model allocates."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine_parity import run
from pagedllm import LLM
from pagedllm.backend.hookspec import Capabilities, StateLayerInfo
from pagedllm.backend.registry import get_backend, register_backend
from pagedllm.errors import ParamError
from pagedllm.models import load_config, load_model
from pagedllm.models.info import read_model_info
from plugin_factory import REFERENCE_FEATURES, make_plugin
from stateful import LFM2, MAMBA2, QWEN3_NEXT
from tiny_models import save_random_model

CONFIGS = {"lfm2": LFM2, "mamba2": MAMBA2, "qwen3_next": QWEN3_NEXT}
ENGINE = dict(max_model_len=64, block_size=16, kv_cache_memory=8 << 20, max_num_seqs=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("state_caps")
    return {name: save_random_model(cfg, root / name) for name, cfg in CONFIGS.items()}


def _backend(name: str, **state) -> str:
    caps = Capabilities(**REFERENCE_FEATURES, dtypes=("float32", "bfloat16"), head_sizes=None, **state)
    return register_backend(make_plugin(name, caps), name).name


def test_model_info_names_each_familys_state(dirs, tiny_model_dirs):
    """``ModelInfo.state`` (read from the config) is what the loaded model allocates, in fp32 and bf16."""
    want = {"lfm2": StateLayerInfo("conv", ("conv",), ("auto",)),
            "mamba2": StateLayerInfo("mamba", ("conv", "ssm"), ("auto", "auto")),
            "qwen3_next": StateLayerInfo("linear_attention", ("conv", "delta_rule"), ("auto", "float32"))}
    for name, path in dirs.items():
        info = read_model_info(path, load_config(path))
        assert info.state == (want[name],)
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(path, backend=get_backend("cpu"), dtype=dtype, device=torch.device("cpu"))
            resolved = tuple(dtype if d == "auto" else getattr(torch, d) for d in info.state[0].dtypes)
            assert tuple(model.state_dtypes) == resolved, name
    llama = tiny_model_dirs["llama"]
    assert read_model_info(llama, load_config(llama)).state == ()  # no state: nothing to check


def test_a_state_dtype_the_backend_lacks_is_refused(dirs):
    """A backend holding float32 state only: a bfloat16 Mamba2 (its SSM state in the model dtype) is refused naming
    the 'mamba' layers, the dtype and the backend; the same checkpoint in float32 runs with the cpu backend's
    tokens. Qwen3-Next's delta-rule state is float32 whatever the model dtype: a bfloat16-only backend refuses it."""
    fp32_state = _backend("state-fp32-only", state_dtypes=("float32",))
    with pytest.raises(ParamError, match=r"Mamba2ForCausalLM's 'mamba' layers keep a bfloat16 recurrent state, "
                                         r"which backend 'state-fp32-only' does not hold") as e:
        LLM(dirs["mamba2"], device=fp32_state, dtype="bfloat16", **ENGINE)
    assert e.value.field == "model"
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    got = run(LLM(dirs["mamba2"], device=fp32_state, dtype="float32", **ENGINE), prompts, max_tokens=6)
    assert got == run(LLM(dirs["mamba2"], device="cpu", dtype="float32", **ENGINE), prompts, max_tokens=6)

    bf16_state = _backend("state-bf16-only", state_dtypes=("bfloat16",))
    with pytest.raises(ParamError, match=r"'linear_attention' layers keep a float32 recurrent state, which backend "
                                         r"'state-bf16-only' does not hold"):
        LLM(dirs["qwen3_next"], device=bf16_state, dtype="bfloat16", **ENGINE)


def test_a_state_op_the_backend_lacks_is_refused(dirs):
    """A backend without state (``state_ops=()``) refuses LFM2 naming its 'conv' layers and the op; one running
    only the conv family runs LFM2 (with the cpu backend's tokens) and refuses Mamba2 (ssm) and Qwen3-Next
    (delta_rule) by their layer types."""
    stateless = _backend("no-state", state_ops=())
    with pytest.raises(ParamError, match=r"Lfm2ForCausalLM's 'conv' layers keep recurrent state through the conv "
                                         r"\(causal conv1d\) state op\(s\), which backend 'no-state' does not run "
                                         r"\(Capabilities.state_ops: none\)"):
        LLM(dirs["lfm2"], device=stateless, dtype="float32", **ENGINE)
    conv_only = _backend("conv-only", state_ops=("conv",))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]
    got = run(LLM(dirs["lfm2"], device=conv_only, dtype="float32", **ENGINE), prompts, max_tokens=6)
    assert got == run(LLM(dirs["lfm2"], device="cpu", dtype="float32", **ENGINE), prompts, max_tokens=6)
    for name, layer, op in (("mamba2", "mamba", "ssm"), ("qwen3_next", "linear_attention", "delta_rule")):
        with pytest.raises(ParamError, match=rf"'{layer}' layers keep recurrent state through the {op} .*backend "
                                             r"'conv-only' does not run \(Capabilities.state_ops: conv\)"):
            LLM(dirs[name], device=conv_only, dtype="float32", **ENGINE)


def test_refused_before_any_weight_is_read(dirs, tmp_path):
    """The refusal comes from the config alone: a folder without weights is refused the same way."""
    bare = tmp_path / "lfm2-config-only"
    os.makedirs(bare)
    shutil.copy(os.path.join(dirs["lfm2"], "config.json"), bare)
    with pytest.raises(ParamError, match="'conv' layers .* backend 'no-state-2' does not run"):
        LLM(str(bare), device=_backend("no-state-2", state_ops=()), dtype="float32", **ENGINE)
