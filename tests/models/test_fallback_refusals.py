"""The transformers fallback never runs a model wrong (issue 28): every ``*ForCausalLM`` transformers ships either
matches HF greedy through the paged cache or is refused at start-up naming the feature.

The sweep (``fallback_sweep.verdict``) builds each architecture's tiny random config (its default shrunk; the
feature real checkpoints have where the default hides it, e.g. LFM2's convolution layers, Granite's logit scale),
then runs 3 prompts of 5, 11 and 19 tokens plus 6 greedy tokens through the paged cache (block 4, chunked prefill
beside decodes) and compares each step's argmax and fp32 logits (1e-3) with HF eager recomputing the whole
sequence. ``EXPECTED`` records the verdicts of transformers 5.25.0; an architecture a later transformers adds is
held to the same rule (matches or refused), and a recorded one must keep its verdict. The rules themselves are
exercised one by one on real models below, through the loader as the engine calls it.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from fallback_sweep import build_pair, causal_lm_architectures, greedy_mismatch, tiny_config, verdict
from pagedllm import LLM
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.fallback_support import AttentionProbe, probe
from pagedllm.models.transformers_impl import TransformersCausalLM, transformers_architecture

_SINKS = "attention sinks"
_LAYER_KINDS = "config.layer_types has layers the paged cache cannot hold"
_CLASS = "does not route attention through AttentionInterface"
_ENC_DEC = "is an encoder-decoder model"
_NO_CLASS = "has no decoder-only *ForCausalLM class"
_HEAD = "transforms the logits after lm_head"
_SHAPES = "are not the paged cache's"
_MLA = "config.kv_lora_rank: multi-head latent attention"
_TWICE = "attend more than once per forward"
_KV_SHARE = "share another layer's KV cache"
_MODULE = "its module does not run as decoder + lm_head"
_KWARGS = "do not pass the forward's keyword arguments"
_SCALE = "scales the logits after lm_head"
RUNS = "matches"
NO_TINY = "no tiny config"

# transformers 5.25.0, model_type -> verdict (RUNS, a phrase of the refusal, or why no tiny config runs in HF).
EXPECTED: dict[str, str] = {
    **dict.fromkeys([
        "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "bitnet", "codegen", "cwm", "dbrx", "dots1",
        "ergo", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "fuyu", "gemma",
        "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "gpt_neox", "gptj", "helium", "hunyuan_v1_dense",
        "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2", "kolibri1", "llama",
        "mellum", "minicpm5_moe", "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral",
        "mixtral", "moshi", "nanochat", "olmo", "olmo2", "olmo3", "olmoe", "opt", "param2moe", "persimmon", "phi",
        "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "sarvam_moe", "seed_oss", "smollm3",
        "solar_open", "starcoder2", "vaultgemma"
    ], RUNS),
    **dict.fromkeys([
        "bailing_hybrid", "bamba", "big_bird", "biogpt", "bloom", "blt", "cpmant", "falcon", "falcon_h1",
        "falcon_mamba", "git", "gpt_neo", "gpt_neox_japanese", "inkling2_loop_text", "inkling2_text",
        "inkling_text", "jamba", "kimi_linear", "lara_mini", "mamba", "mamba2", "megatron-bert", "mpt",
        "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
        "qwen4_exp", "qwen4_exp_text", "rembert", "roformer", "rwkv", "stablelm", "trocr", "xglm", "xlstm", "zamba2"
    ], _CLASS),
    **dict.fromkeys([
        "bert", "bert-generation", "ctrl", "emu3", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "got_ocr2",
        "gpt-sw3", "gpt2", "mllama", "moss_transcribe_diarize", "openai-gpt", "reformer", "xlm", "xlnet"
    ], _NO_CLASS),
    **dict.fromkeys([
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen",
        "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "whisper"
    ], _ENC_DEC),
    **dict.fromkeys([
        "axk2", "deepseek_v32", "deepseek_v4", "dots3_note", "dots3_note_text", "glm_moe_dsa", "granitemoehybrid",
        "hy_v4", "kolibri1_1", "lfm2", "lfm2_moe", "lfm3", "llama4", "llama4_text", "minimax", "recurrent_gemma",
        "zamba", "zaya"
    ], _LAYER_KINDS),
    **dict.fromkeys([
        "flint", "gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash"
    ], _SINKS),
    **dict.fromkeys([
        "gemma3n_text", "gemma4_text", "gemma4_unified_assistant", "gemma4_unified_text"
    ], _KV_SHARE),
    **dict.fromkeys([
        "cohere", "cohere2", "cohere2_moe", "granite", "granitemoe", "granitemoeshared"
    ], _SCALE),
    **dict.fromkeys([
        "camembert", "data2vec-text", "ernie", "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta",
        "xlm-roberta-xl", "xmod"
    ], _HEAD),
    **dict.fromkeys([
        "axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3", "sarvam_mla", "youtu"
    ], _MLA),
    **dict.fromkeys(["gpt_bigcode", "laguna"], _SHAPES),
    **dict.fromkeys([
        "diffllama", "hrm_text"
    ], _TWICE),
    **dict.fromkeys([
        "afmoe", "doge", "electra", "jetmoe", "modernbert-decoder"
    ], _MODULE),
    **dict.fromkeys([
        "nemotron"
    ], _KWARGS),
    **dict.fromkeys([
        "cohere_compass_text", "dory", "gemma4_assistant", "phi4_multimodal"
    ], NO_TINY),
}


@pytest.fixture(scope="module")
def backend(ref_backend):
    return ref_backend


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(causal_lm_architectures()))
def test_every_architecture_is_refused_or_matches_hf(backend, model_type):
    got = verdict(model_type, causal_lm_architectures()[model_type], backend)
    print(f"{model_type}: {got}")
    assert not got.split("; ")[-1].startswith(("WRONG", "CRASH")), got
    expected = EXPECTED.get(model_type)
    if expected is None:  # an architecture newer than the table: refused, or matches HF
        assert got.split("; ")[-1].startswith((RUNS, "refused: ")), got
    elif expected == RUNS:
        assert got.endswith(RUNS), got
    elif expected == NO_TINY:
        assert got.startswith(NO_TINY), got
    else:
        assert "refused: " in got and expected in got, got


def _saved(config, path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_lfm2_convolution_layers_are_refused_before_any_weight_is_read(tmp_path, backend):
    """Issue 28: LFM2 ran wrong from its second token (its short-convolution state is not carried between steps).
    It runs natively now (tests/models/test_lfm2.py); asked for the transformers path, it is still refused."""
    path = _saved(tiny_config("lfm2", "Lfm2ForCausalLM"), tmp_path / "lfm2")
    with open(os.path.join(path, "model.safetensors"), "wb"):  # no weights at all: the refusal comes first
        pass
    with pytest.raises(UnsupportedModelError, match=r"Lfm2ForCausalLM.*config\.layer_types has layers the paged "
                                                    r"cache cannot hold \(conv: a convolution state; layers 0, 2\)"):
        load_model(path, backend=backend, dtype=torch.float32, device=torch.device("cpu"), model_impl="transformers")


def test_gpt_oss_sinks_are_refused_before_any_weight_is_read(tmp_path, backend):
    """Issue 28: GPT-OSS ran wrong from its first tokens (attention sinks, alternating windows). It runs natively now
    (tests/models/test_gpt_oss.py); the fallback, asked for by ``model_impl="transformers"``, still refuses it."""
    path = _saved(tiny_config("gpt_oss", "GptOssForCausalLM"), tmp_path / "gpt_oss")
    with open(os.path.join(path, "model.safetensors"), "wb"):
        pass
    with pytest.raises(UnsupportedModelError, match=r"GptOssForCausalLM: model\.layers\.0\.self_attn\.sinks: "
                                                    r"attention sinks"):
        load_model(path, backend=backend, dtype=torch.float32, device=torch.device("cpu"), model_impl="transformers")
    with pytest.raises(UnsupportedModelError, match=r"GptOssForCausalLM: .*attention sinks"):  # as users start it
        LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
            model_impl="transformers")


def test_gpt_oss_sinks_are_seen_by_the_probe_too(backend):
    """Without the parameter-name rule, the probe sees the sinks arrive at the attention function as ``s_aux``."""
    _, paged = build_pair(tiny_config("gpt_oss", "GptOssForCausalLM"))
    model = TransformersCausalLM(paged, backend, check=False)
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(GptOssAttention\) passes s_aux to the attention "
                                                    r"function \(attention sinks"):
        probe(model, model.architecture)


def test_layers_that_never_attend_are_refused_by_the_probe(backend):
    """LFM2's convolution layers, were its layer_types and modules not read: the probe sees them skip attention."""
    _, paged = build_pair(tiny_config("lfm2", "Lfm2ForCausalLM"))
    model = TransformersCausalLM(paged, backend, check=False)
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 2\] never call attention \(their mixer: .*"
                                                    r"Lfm2ShortConv"):
        probe(model, model.architecture)


def test_a_window_the_module_does_not_pass_is_refused(backend):
    """HF masks layer 1 to a window of 8 (config.layer_types); a module that does not pass that window to the
    attention function would attend to the whole prefix."""
    config = tiny_config("qwen2", "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8,
                         max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    _, paged = build_pair(config)
    assert TransformersCausalLM(paged, backend).architecture == "Qwen2ForCausalLM"  # as HF ships it: accepted
    paged.model.layers[1].self_attn.sliding_window = None
    with pytest.raises(UnsupportedModelError, match=r"layer 1: HF masks it as causal attention within a window "
                                                    r"of 8 \(config\.layer_types / config\.sliding_window\) but its "
                                                    r"attention module passes sliding_window=None"):
        TransformersCausalLM(paged, backend)


def test_logit_transforms_of_the_head_are_refused(backend):
    """Granite divides its logits by config.logits_scaling (named up front); RoBERTa's LM head is a dense + norm
    before the output embedding, which only the probe's comparison with the model's own logits can see."""
    with pytest.raises(UnsupportedModelError, match=r"config\.logits_scaling scales the logits after lm_head"):
        transformers_architecture(tiny_config("granite", "GraniteForCausalLM"))  # Granite 3: logits_scaling 8
    _, paged = build_pair(tiny_config("roberta", "RobertaForCausalLM"))
    with pytest.raises(UnsupportedModelError, match=r"RobertaForCausalLM\.forward transforms the logits after "
                                                    r"lm_head"):
        TransformersCausalLM(paged, backend)


def test_bidirectional_encoders_are_refused(backend):
    """A BERT-style class with its default config (is_decoder=False) attends both ways."""
    _, paged = build_pair(tiny_config("roberta", "RobertaForCausalLM", is_decoder=False))
    with pytest.raises(UnsupportedModelError, match=r"layer 0 runs bidirectional attention, not causal attention"):
        TransformersCausalLM(paged, backend)


def test_shared_attention_is_refused(backend):
    """DiffLlama calls attention twice per layer: both calls would write the same paged KV."""
    _, paged = build_pair(tiny_config("diffllama", "DiffLlamaForCausalLM"))
    with pytest.raises(UnsupportedModelError, match=r"layers \[0, 1\] attend more than once per forward"):
        TransformersCausalLM(paged, backend)


def test_accepted_models_are_probed_and_match(backend):
    """The probe records one call per layer with nothing the paged attention ignores, and the model runs as HF."""
    hf, paged = build_pair(tiny_config("olmo2", "Olmo2ForCausalLM"))
    model = TransformersCausalLM(paged, backend)
    rec = AttentionProbe()
    with torch.inference_mode():
        model.decoder(input_ids=torch.tensor([[3, 4, 5]]), position_ids=torch.tensor([[0, 1, 2]]), use_cache=False,
                      pagedllm=rec)
    assert [(c["layer_idx"], c["extra"]) for c in rec.calls] == [(0, []), (1, [])]
    assert greedy_mismatch(hf, model, backend) is None


def test_expected_table_covers_transformers():
    """The recorded verdicts name only architectures transformers still ships (a stale row fails here)."""
    assert set(EXPECTED) <= set(causal_lm_architectures()), sorted(set(EXPECTED) - set(causal_lm_architectures()))
