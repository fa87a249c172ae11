"""Native models vs HF transformers on the same weights (fp32): logits at every position, through the paged KV
cache with full prefill, batched chunked prefill with cached context, and single-token decodes."""

from __future__ import annotations

import os
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm.models import DEFAULT_GGUF_NAME, CausalLM, load_model, load_tokenizer, resolve_model_path
from tiny_models import TINY_MODEL_SPECS

BLOCK_SIZE = 4
PROMPT_LENS = (20, 17)  # both longer than the mistral/qwen2_swa sliding window (8) and than one block

# Schedules over two sequences A=0 and B=1: per step, (seq, new tokens), decodes (1 token) first.
FULL_PREFILL = [[(0, 20), (1, 17)]]
CHUNKED = [
    [(0, 7), (1, 5)],  # two first chunks
    [(0, 1), (1, 6)],  # a decode beside a chunk with cached context
    [(1, 1), (0, 5)],  # and the other way round
    *[[(0, 1), (1, 1)]] * 5,  # batched decodes; B ends after these
    *[[(0, 1)]] * 2,  # A decodes alone
]


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def run_schedule(model: CausalLM, backend, prompts: list[list[int]], schedule) -> list[torch.Tensor]:
    """Teacher-forced run of ``schedule`` through the paged cache; returns each prompt's logits ``[len, vocab]``."""
    blocks_per_seq = [(len(p) + BLOCK_SIZE - 1) // BLOCK_SIZE for p in prompts]
    ids = list(range(1, sum(blocks_per_seq) + 1))  # block 0 stays unused; tables are scattered on purpose
    random.Random(0).shuffle(ids)
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(ids[start:start + n])
        start += n
    spec = KVCacheSpec(model.num_layers, sum(blocks_per_seq) + 1, BLOCK_SIZE, model.num_kv_heads, model.head_size,
                       torch.float32, torch.device("cpu"), mla=getattr(model, "kv_cache_mla", False))
    model.kv_caches = backend.allocate_kv_cache(spec)
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in schedule:
        qlens = [n for _, n in step]
        slens = [done[s] + n for s, n in step]
        tokens = [t for s, n in step for t in prompts[s][done[s]:done[s] + n]]
        positions = [p for s, n in step for p in range(done[s], done[s] + n)]
        meta = AttentionMetadata.build(qlens, slens, [tables[s] for s, _ in step], BLOCK_SIZE)
        hidden = model(torch.tensor(tokens), torch.tensor(positions), meta)
        logits = model.compute_logits(hidden)
        for i, (s, n) in enumerate(step):
            rows[s].append(logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
            done[s] += n
    assert done == [len(p) for p in prompts], "schedule must cover every prompt token"
    return [torch.cat(r) for r in rows]


@pytest.fixture(scope="module", params=list(TINY_MODEL_SPECS))
def tiny_pair(request, tiny_model_dirs, ref_backend):
    """(name, our model, HF model, prompts, HF logits per prompt) for one tiny model."""
    path = tiny_model_dirs[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = _prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    return request.param, ours, hf, prompts, expected


def assert_logits_match(name: str, got, expected) -> None:
    """fp32 logits within 1e-4 of HF at every position, with the same argmax; prints the max error seen."""
    for g, e in zip(got, expected):
        err = (g - e).abs().max().item()
        print(f"{name}: max |logit diff| = {err:.2e} (logit std {e.std().item():.2f})")
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))


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
    prompts = _prompts(hf32.config.vocab_size)
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
def smollm2(ref_backend):
    """(path, tokenizer, our model, HF model) for the embedded SmolLM2 GGUF, loaded once (~30 s)."""
    path = resolve_model_path(None)
    tok = load_tokenizer(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return path, tok, ours, hf


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
