"""Native models vs HF transformers on the same weights (fp32): logits at every position, through the paged KV
cache with full prefill, batched chunked prefill with cached context, and single-token decodes."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.models import DEFAULT_GGUF_NAME, load_model, load_tokenizer, resolve_model_path
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, hf_eager, parity_prompts, run_schedule
from tiny_models import TINY_MODEL_SPECS

@pytest.fixture(scope="module", params=list(TINY_MODEL_SPECS))
def tiny_pair(request, tiny_model_dirs, ref_backend):
    """(name, our model, HF model, prompts, HF logits per prompt) for one tiny model."""
    path = tiny_model_dirs[request.param]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    return request.param, ours, hf, prompts, expected


@pytest.mark.parametrize("schedule", [FULL_PREFILL, CHUNKED], ids=["full_prefill", "chunked_decode"])
def test_logits_match_hf(tiny_pair, ref_backend, schedule):
    name, ours, _, prompts, expected = tiny_pair
    with torch.inference_mode():
        got = run_schedule(ours, ref_backend, prompts, schedule)
    assert_logits_match(name, got, expected)


def test_model_attributes(tiny_pair):
    name, ours, hf, _, _ = tiny_pair
    cfg = hf.config
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert ours.head_size == {"qwen3": 128}.get(name, 64)
    assert ours.vocab_size == cfg.vocab_size and ours.max_model_len == cfg.max_position_embeddings
    assert ours.eos_token_ids == [2]
    assert ours.sliding_window == {"mistral": 8}.get(name)
    assert ours.layer_sliding_windows == {"mistral": [8, 8], "qwen2_swa": [None, 8]}.get(name, [None, None])
    assert ours.tie_word_embeddings == (name == "qwen3")
    assert ours.cos_sin_cache.shape == (cfg.max_position_embeddings, ours.head_size)
    assert ours.cos_sin_cache.dtype == torch.float32
    # q/k/v and gate/up are fused into single matmuls
    attn, mlp = ours.layers[0].self_attn, ours.layers[0].mlp
    assert attn.qkv_proj.weight.shape[0] == (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * ours.head_size
    assert mlp.gate_up_proj.weight.shape[0] == 2 * cfg.intermediate_size
    assert (attn.qkv_proj.bias is not None) == name.startswith("qwen2")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp32(tiny_model_dirs, ref_backend, dtype):
    """Half-precision weights run end to end, and stray from the fp32 oracle no more than HF does in that dtype."""
    path = tiny_model_dirs["llama"]
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf_half = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    ours = load_model(path, backend=ref_backend, dtype=dtype, device=torch.device("cpu"))
    assert ours.embed_tokens.weight.dtype == dtype and ours.layers[0].self_attn.qkv_proj.weight.dtype == dtype
    prompts = parity_prompts(hf32.config.vocab_size)
    with torch.inference_mode():
        got = run_schedule(ours, ref_backend, prompts, CHUNKED)
        for g, p in zip(got, prompts):
            e32 = hf32(torch.tensor([p])).logits[0]
            e_half = hf_half(torch.tensor([p])).logits[0]
            assert g.dtype == dtype
            err, hf_err = (g.float() - e32).abs().max().item(), (e_half.float() - e32).abs().max().item()
            print(f"{dtype}: max |logit diff| vs fp32: ours {err:.3f}, HF {hf_err:.3f}")
            assert err <= 1.5 * hf_err + 1e-2


def test_sharded_safetensors(tmp_path, tiny_model_dirs, ref_backend):
    path = tiny_model_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    single = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    sharded = load_model(str(tmp_path), backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the embedded real model (GGUF) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(ref_backend, smollm2_hf):
    """(path, tokenizer, our model, HF model) for the embedded SmolLM2 GGUF, loaded once (HF's: once per session)."""
    path = resolve_model_path(None)
    tok = load_tokenizer(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    return path, tok, ours, smollm2_hf


def test_gguf_logits_match_hf(smollm2, ref_backend):
    path, tok, ours, hf = smollm2
    assert os.path.basename(path) == DEFAULT_GGUF_NAME
    assert tok is not None and tok.is_fast
    prompts = [tok("The capital of France is").input_ids,
               tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]]
    assert ours.eos_token_ids == [tok.eos_token_id]
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        lens = [len(p) for p in prompts]
        schedule = [[(0, lens[0] - 2), (1, lens[1] - 3)], [(0, 1), (1, 2)], [(0, 1), (1, 1)]]
        got = run_schedule(ours, ref_backend, prompts, schedule)
    assert_logits_match("SmolLM2 GGUF", got, expected)
    assert tok.decode(expected[0][-1].argmax().item()).strip() == "Paris"


# ---- paths and errors --------------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="model: /no/such/model does not exist"):
        resolve_model_path("/no/such/model")


def test_unsupported_architecture(tmp_path, ref_backend):
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]) \
        .save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model architecture GPT2LMHeadModel"):
        load_model(str(tmp_path), backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))


def test_tiny_folder_has_no_tokenizer(tiny_llama):
    assert resolve_model_path(tiny_llama) == os.path.abspath(tiny_llama)
    assert load_tokenizer(tiny_llama) is None
