"""GPT-OSS native vs HF (issue 28): attention sinks, alternating sliding (8) / full layers, YaRN rope, q/k/v/o
biases, the biased top-k-then-softmax router and the clamped SwiGLU experts (interleaved gate/up). Tiny random
configs with odd shapes (10 heads over 2 KV heads, head 48, vocab 500), sinks drawn large enough to matter and a
SwiGLU limit the activations cross: fp32 logits within 1e-4 of HF eager through the paged cache (full prefill and
chunked schedules, reference and CPU backends), greedy parity through the engine (chunked prefill, prefix caching),
MXFP4 checkpoints loaded dequantized (vs HF's own ``Mxfp4Config(dequantize=True)``), and the refusal on a backend
without sinks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_parity import assert_preemption_parity
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, hf_eager, parity_prompts, run_schedule
from model_parity import assert_engine_parity
from pagedllm import LLM
from pagedllm.backend import ref_ops
from pagedllm.backend.hookspec import Capabilities
from pagedllm.backend.registry import get_backend, register_backend
from pagedllm.errors import ParamError
from pagedllm.models import CausalLM, load_model
from pagedllm.models.gpt_oss import GptOssExperts, GptOssMoeBlock, Mxfp4Weights
from pagedllm.models.info import read_model_info
from pagedllm.models.loader import load_config
from plugin_factory import make_plugin
from tiny_models import save_random_model

_BASE = dict(model_type="gpt_oss", vocab_size=500, hidden_size=240, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=10, num_key_value_heads=2, head_dim=48, max_position_embeddings=512,
             initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
             swiglu_limit=2.5)
CONFIGS = {
    # layer_types as GPT-OSS ships them (sliding first, alternating), YaRN over a short original context
    "gpt_oss": dict(_BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 128}),
    # full attention first, plain rope, GQA 3:1
    "gpt_oss_full_first": dict(_BASE, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                               layer_types=["full_attention", "sliding_attention"],
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def make_gpt_oss(name: str, out_dir, **overrides) -> str:
    """The tiny model, its sinks redrawn with std 2 (HF inits them with the initializer range: too small to tell
    a model that ignores them)."""
    path = save_random_model({**CONFIGS[name], **overrides}, out_dir)
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    g = torch.Generator().manual_seed(7)
    for key in [k for k in sd if k.endswith("self_attn.sinks")]:
        sd[key] = torch.randn(sd[key].shape, generator=g) * 2.0
    save_file(sd, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def gpt_oss_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpt_oss_models")
    return {name: make_gpt_oss(name, root / name) for name in CONFIGS}


@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpt_oss_logits_match_hf(gpt_oss_dirs, ref_backend, name, backend_name):
    path = gpt_oss_dirs[name]
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    hf = hf_eager(path)
    ours = load_model(path, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, CausalLM) and all(isinstance(layer.mlp, GptOssMoeBlock) for layer in ours.layers)
    assert ours.layer_sliding_windows == [8 if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert None in ours.layer_sliding_windows and 8 in ours.layer_sliding_windows
    torch.testing.assert_close(ours.layers[0].self_attn.sinks, hf.model.layers[0].self_attn.sinks)
    prompts = parity_prompts(hf.config.vocab_size)  # 20 and 17 tokens: past the window and several blocks of 4
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, backend, prompts, schedule), expected)


def test_gpt_oss_sinks_change_the_output(gpt_oss_dirs, ref_backend):
    """The oracle would not notice sinks ignored if they did nothing: zeroing them changes HF's logits."""
    hf = hf_eager(gpt_oss_dirs["gpt_oss"])
    ids = torch.tensor([parity_prompts(500)[0]])
    with torch.inference_mode():
        before = hf(ids).logits
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: plain softmax
        after = hf(ids).logits
    assert (before - after).abs().max() > 1e-2


def test_gpt_oss_experts_match_hf_experts():
    """The clamped SwiGLU over interleaved gate/up, biases and top-k-then-softmax routing, on inputs large enough
    that the clamp bites on both sides."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = AutoConfig.for_model(**{**_BASE, "swiglu_limit": 7.0})
    torch.manual_seed(0)
    hf = GptOssMLP(cfg).float().eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = GptOssMoeBlock(cfg)
    ours.load_state_dict({k: v for k, v in hf.state_dict().items()}, strict=True)
    x = torch.randn(37, cfg.hidden_size) * 2
    with torch.inference_mode():
        h = x @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
        assert (h[:, ::2] > 7).any() and (h[:, 1::2].abs() > 7).any()  # both clamps active
        want, _ = hf(x[None])
        torch.testing.assert_close(ours(x), want[0], rtol=1e-5, atol=1e-5)
    assert isinstance(ours.experts, GptOssExperts) and ours.experts.alpha == 1.702


@pytest.mark.parametrize("device", ["cpu", "cpu-static"])
def test_gpt_oss_greedy_parity_engine(gpt_oss_dirs, device):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16 and window 8), 16-token chunks, prefix hits,
    on the CPU backends (sinks in the C++ decode kernel once built, else the float32 path; the static-shape one
    pads every step to its buckets)."""
    path = gpt_oss_dirs["gpt_oss"]
    llm = assert_engine_parity(path, hf_eager(path), device=device)
    assert isinstance(llm.llm_engine.model, CausalLM)
    assert llm.llm_engine.backend.capabilities.attention_sinks


def test_gpt_oss_greedy_parity_under_preemption(gpt_oss_dirs):
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens: preempted and recomputed, still HF's tokens."""
    assert_preemption_parity(gpt_oss_dirs["gpt_oss_full_first"], 500, max_len=40)


def test_gpt_oss_routing_matches_hf(gpt_oss_dirs, ref_backend):
    """Every token goes to HF's experts (top-k of the biased router logits), chunked schedule included."""
    path = gpt_oss_dirs["gpt_oss"]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    theirs, mine = [], []
    hf.model.layers[2].mlp.router.register_forward_hook(lambda m, a, out: theirs.append(out[2]))
    ours.layers[2].mlp.router.register_forward_hook(lambda m, a, out: mine.append(out[1]))
    prompts = parity_prompts(500)
    with torch.inference_mode():
        for p in prompts:
            hf(torch.tensor([p]))
        run_schedule(ours, ref_backend, prompts, CHUNKED)
    per_seq = [[], []]
    for step, ids in zip(CHUNKED, mine):
        start = 0
        for seq, n in step:
            per_seq[seq].append(ids[start:start + n])
            start += n
    for h, o in zip(theirs, per_seq):
        assert torch.equal(h.sort(-1).values, torch.cat(o).sort(-1).values)


def test_gpt_oss_model_info_and_refusals(gpt_oss_dirs):
    path = gpt_oss_dirs["gpt_oss"]
    info = read_model_info(path, load_config(path))
    assert info.attention_sinks and info.sliding_window == 8 and info.architecture == "GptOssForCausalLM"
    # a backend with its own attention but no sinks: refused at start-up, naming model, feature and backend
    caps = Capabilities(dtypes=("float32",), head_sizes=None, sliding_window=True)
    register_backend(make_plugin("gptoss-nosinks", caps, paged_attention=ref_ops.paged_attention), "gptoss-nosinks")
    with pytest.raises(ParamError, match=r"GptOssForCausalLM uses attention sinks.*'gptoss-nosinks'"):
        LLM(path, device="gptoss-nosinks", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-layout experts ``[E, in, out]`` -> the published checkpoints' ``_blocks`` ``[E, out, in/32, 16]`` (two
    e2m1 codes a byte, low nibble first) and ``_scales`` ``[E, out, in/32]`` (exponent + 127): round to nearest."""
    x = w.transpose(1, 2).unflatten(-1, (-1, 32))  # [E, out, in/32, 32]
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = (x / torch.exp2(exp)[..., None])[..., None].sub(_FP4).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> str:
    """The tiny model (hidden 256: MXFP4 blocks are 32 wide) with its experts stored as MXFP4, as published."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    dense = make_gpt_oss("gpt_oss", root / "dense", hidden_size=256)
    sd = load_file(os.path.join(dense, "model.safetensors"))
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[key + "_blocks"], sd[key + "_scales"] = _to_mxfp4(sd.pop(key))
    out = root / "mxfp4"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_gpt_oss_mxfp4_loads_dequantized(mxfp4_dir):
    """Logits within 1e-4 of HF loading the same MXFP4 files with ``Mxfp4Config(dequantize=True)``, through the
    paged cache on the CPU backend; the engine sees a dense checkpoint."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    backend = get_backend("cpu")
    ours = load_model(mxfp4_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    torch.testing.assert_close(ours.layers[1].mlp.experts.gate_up_proj, hf.model.layers[1].mlp.experts.gate_up_proj,
                               rtol=0, atol=0)
    assert read_model_info(mxfp4_dir, load_config(mxfp4_dir)).quantization is None
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("gpt_oss_mxfp4", run_schedule(ours, backend, prompts, schedule), expected)
    llm = LLM(mxfp4_dir, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
              skip_tokenizer_init=True)
    assert isinstance(llm.llm_engine.model, CausalLM) and llm.llm_engine.config.quantization is None


def test_mxfp4_weights_pass_other_tensors_through(mxfp4_dir):
    from pagedllm.models.weights import SafetensorsWeights

    w = Mxfp4Weights(SafetensorsWeights(mxfp4_dir))
    assert "model.layers.0.mlp.experts.down_proj" in w and "model.layers.0.mlp.experts.down_proj_bias" in w
    assert "model.layers.0.mlp.experts.up_proj" not in w
    assert w.take("model.layers.0.mlp.experts.down_proj").shape == (4, 64, 256)
    assert w.take("model.layers.0.self_attn.sinks").shape == (10,)
