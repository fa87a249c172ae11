"""Gemma 3 with vision natively (SigLIP tower + ``Gemma3MultiModalProjector`` + Gemma 3 decoder) against HF
transformers on a tiny random checkpoint (tests/support/tiny_gemma3_vlm.py: 16 soft tokens per image, sliding window
12 on two of three layers), images made here with PIL in several sizes and aspect ratios.

The feature under test is HF's bidirectional attention among the tokens of one image (``token_type_ids``): the
engine hands each step's image spans to the attention (``AttentionMetadata.mm_prefix_ranges``), never ends a chunk
or a prefix-cache hit inside an image, and a backend that does not declare ``Capabilities.mm_prefix_lm`` refuses the
model. Oracles: HF's processor (token ids, pixel values, token types), HF's ``get_image_features``, HF's
``generate`` (greedy tokens, with the processor's ``token_type_ids``) and HF's forward (log-probabilities of every
prompt and output token), core's reference attention (conformance cases). Turning the spans off makes the greedy
tokens differ from HF's, so the parity tests prove the feature.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from plugin_factory import REFERENCE_FEATURES, make_plugin

from pagedllm import LLM, SamplingParams
from pagedllm.backend import ref_ops
from pagedllm.backend.hookspec import Capabilities
from pagedllm.backend.registry import Backend
from pagedllm.multimodal.registry import processor_class, supported_modalities
from test_llava import image
from tiny_gemma3_vlm import SLIDING_WINDOW, TOKENS_PER_IMAGE, tiny_gemma3_vlm_model

BLOCK = 8
PROMPT_1 = "<start_of_turn>user\nLook: <start_of_image> What is in the picture?<end_of_turn>\n<start_of_turn>model\n"
PROMPT_2 = "<start_of_turn>user\ncompare <start_of_image> with <start_of_image> please.<end_of_turn>\n"
IMAGES = {"wide": image(40, 150, 1), "large": image(200, 180, 2), "small": image(20, 28, 3),
          "tall": image(130, 50, 4)}


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_gemma3_vlm_model()


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_path, backend="pil")


@pytest.fixture(scope="module")
def llm(model_path):
    """A token budget of 24: a two-image prompt needs several chunks, each ending outside the images."""
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=24,
             max_num_seqs=4, num_gpu_blocks_override=128) as engine:
        yield engine


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def spans_of(token_type_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` runs of ``token_type_ids == 1`` (HF's image blocks)."""
    t = token_type_ids.tolist() + [0]
    out, start = [], None
    for i, v in enumerate(t):
        if v == 1 and start is None:
            start = i
        elif v != 1 and start is not None:
            out.append((start, i))
            start = None
    return out


def hf_greedy(model, inputs, n: int) -> list[int]:
    return model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()


def hf_logprobs(model, inputs, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    types = torch.nn.functional.pad(inputs["token_type_ids"], (0, len(tokens) - inputs["token_type_ids"].shape[1]))
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(tokens) - 1), ids[0, 1:]]


class ChunkRecorder:
    """Records every prefill chunk the engine's real scheduler plans (request id, first token, token count)."""

    def __init__(self, scheduler):
        self.scheduler, self.schedule, self.chunks = scheduler, scheduler.schedule, []

    def __enter__(self):
        def schedule(*args, **kw):
            out = self.schedule(*args, **kw)
            self.chunks += [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens,
                             [(f.mm_position.offset, f.mm_position.end) for f in s.request.mm_features])
                            for s in out.scheduled]
            return out

        self.scheduler.schedule = schedule
        return self

    def __exit__(self, *exc):
        del self.scheduler.schedule  # (the instance attribute: the class's method again)


def test_processor_matches_hf(model_path, hf):
    from pagedllm.models import load_config

    config = load_config(model_path)
    assert supported_modalities(config) == {"image"}
    _, processor = hf
    ours = processor_class(config)(model_path, config)
    for names in (("wide", "large"), ("small", "tall")):
        images = [IMAGES[n] for n in names]
        got = ours(PROMPT_2, None, images)
        want = processor(text=PROMPT_2, images=images, return_tensors="pt")
        assert got.prompt_token_ids == want["input_ids"][0].tolist()
        assert [(f.mm_position.offset, f.mm_position.end) for f in got.mm_features] == \
            spans_of(want["token_type_ids"][0])
        for i, f in enumerate(got.mm_features):
            assert f.mm_position.length == TOKENS_PER_IMAGE
            torch.testing.assert_close(f.data["pixel_values"], want["pixel_values"][i:i + 1], atol=0, rtol=0)
    # token ids carrying one <start_of_image> per image: each becomes the processor's full image sequence
    tok = processor.tokenizer
    head, tail = PROMPT_1.split("<start_of_image>")
    ids = tok.encode(head, add_special_tokens=False) + [tok.convert_tokens_to_ids("<start_of_image>")] + \
        tok.encode(tail, add_special_tokens=False)
    got = ours(None, ids, [IMAGES["wide"]])
    seq = tok.encode(processor.full_image_sequence, add_special_tokens=False)
    assert got.prompt_token_ids == ids[:len(tok.encode(head, add_special_tokens=False))] + seq + \
        tok.encode(tail, add_special_tokens=False)
    (f,) = got.mm_features
    assert got.prompt_token_ids[f.mm_position.offset:f.mm_position.end] == [ours.image_token_id] * TOKENS_PER_IMAGE
    from pagedllm.errors import ParamError

    with pytest.raises(ParamError, match="^prompt_token_ids:.*1 image placeholders.*2 images"):
        ours(None, ids, [IMAGES["wide"], IMAGES["tall"]])


def test_image_features_match_hf(hf, llm):
    model, processor = hf
    images = [IMAGES["large"], IMAGES["wide"], IMAGES["small"]]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixels).pooler_output
    got = llm.llm_engine.model.embed_multimodal([{"pixel_values": pixels[i:i + 1]} for i in range(3)])
    assert want.shape == (3, TOKENS_PER_IMAGE, 64)
    torch.testing.assert_close(torch.stack(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt,names", [(PROMPT_1, ("tall",)), (PROMPT_2, ("wide", "small"))])
def test_greedy_and_logprobs_match_hf_with_images_kept_whole(hf, llm, prompt, names):
    model, processor = hf
    images = [IMAGES[n] for n in names]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    want = hf_greedy(model, inputs, 8)
    with ChunkRecorder(llm.llm_engine.scheduler) as rec:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": list(images)}},
                           greedy(8, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want
    ref = hf_logprobs(model, inputs, out.prompt_token_ids + want)
    prompt_lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    out_lp = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, want)]
    torch.testing.assert_close(torch.tensor(prompt_lp + out_lp), ref, atol=1e-4, rtol=1e-4)
    # chunked prefill (24 tokens a step): several prefill chunks, none ending inside an image
    n = len(out.prompt_token_ids)
    prefill = [(lo, k, spans) for _, lo, k, spans in rec.chunks if lo < n]
    assert len(prefill) >= 2
    for lo, k, spans in prefill:
        assert not any(a < lo + k < b or a < lo < b for a, b in spans), (lo, k, spans)


def test_a_token_budget_shorter_than_an_image_is_refused(model_path):
    """A 12-token budget is shorter than an image's 16 tokens, which are never split across steps: refused at
    start-up naming the field, nothing left running."""
    from pagedllm.errors import ParamError

    with pytest.raises(ParamError, match=r"^max_num_batched_tokens: 12 is less than one image's 16 tokens"):
        LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=12,
            num_gpu_blocks_override=64, max_model_len=256)
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=TOKENS_PER_IMAGE,
             num_gpu_blocks_override=64, max_model_len=256) as llm:
        with ChunkRecorder(llm.llm_engine.scheduler) as rec:
            llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": [IMAGES["large"], IMAGES["tall"]]}},
                         greedy(2), use_tqdm=False)
    spans = rec.chunks[0][3]
    assert [(lo, lo + k) for _, lo, k, _ in rec.chunks if any(a <= lo < b for a, b in spans)] == spans


def test_cpu_static_matches_hf(model_path, hf):
    """cpu-static (the CPU attention, static buckets): image steps run eagerly with their spans, text steps and
    decodes on the buckets; the tokens are HF's."""
    model, processor = hf
    images = [IMAGES["wide"], IMAGES["tall"]]
    inputs = processor(text=PROMPT_2, images=images, return_tensors="pt")
    with LLM(model_path, device="cpu-static", dtype="float32", block_size=BLOCK, max_num_batched_tokens=24,
             max_num_seqs=2, num_gpu_blocks_override=64, max_model_len=256) as llm:
        assert llm.llm_engine.backend.capabilities.mm_prefix_lm
        out = llm.generate([{"prompt": PROMPT_2, "multi_modal_data": {"image": images}}, "a text prompt"],
                           greedy(6), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(model, inputs, 6)


def test_without_the_spans_the_tokens_differ_from_hf(hf, llm):
    """The same engine with the model's spans turned off (causal image tokens): HF's tokens no longer come out, so
    the parity tests above check the bidirectional spans. (Prompt logprobs keep both runs off the prefix cache.)"""
    model, processor = hf
    images = [IMAGES["large"], IMAGES["tall"]]
    inputs = processor(text=PROMPT_2, images=images, return_tensors="pt")
    want = hf_greedy(model, inputs, 8)
    no_types = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    assert hf_greedy(model, no_types, 8) != want  # HF itself: the token types change the tokens
    engine = llm.llm_engine
    engine.model.mm_prefix_lm = False
    try:
        off = llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": images}}, greedy(8, prompt_logprobs=0),
                           use_tqdm=False)[0].outputs[0].token_ids
    finally:
        del engine.model.mm_prefix_lm  # (the class attribute: True)
    assert off != want
    assert off == hf_greedy(model, no_types, 8)  # ... and they are HF's own causal-only tokens
    on = llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": images}}, greedy(8, prompt_logprobs=0),
                      use_tqdm=False)[0].outputs[0].token_ids
    assert on == want


def test_prefix_cache_hits_the_same_image_never_another_and_never_ends_inside_one(model_path, hf):
    model, processor = hf
    prompt = PROMPT_1 + "Describe every part of it, slowly and in detail, then stop."
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64,
             num_gpu_blocks_override=64, max_model_len=256) as llm:
        engine = llm.llm_engine
        runner = engine.worker.runner.encoder_runner
        a = IMAGES["wide"]
        first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, greedy(4), use_tqdm=False)[0]
        (feature,) = engine.mm_processor(prompt, None, [a]).mm_features
        offset, end = feature.mm_position.offset, feature.mm_position.end
        n = len(first.prompt_token_ids)
        assert offset % BLOCK and end % BLOCK and (n - 1) // BLOCK * BLOCK > end  # the image straddles blocks
        assert runner.num_encoded == 1 and engine.get_stats().prefix_hits == 0
        again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a.copy()}}, greedy(4),
                             use_tqdm=False)[0]
        assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK
        assert engine.get_stats().prefix_hits == again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert runner.num_encoded == 1
        # other pixels: the same prompt tokens, but only the blocks before the image's first one hit
        other_image = a.transpose(0)
        other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": other_image}}, greedy(4),
                             use_tqdm=False)[0]
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.num_cached_tokens == offset // BLOCK * BLOCK
        inputs = processor(text=prompt, images=[other_image], return_tensors="pt")
        assert other.outputs[0].token_ids == hf_greedy(model, inputs, 4)
        # a prompt whose cached blocks end inside the image (the first prompt's token ids, cut just after the
        # image): the hit is cut back to the image's first block, and the tokens are HF's on the same ids
        ids = first.prompt_token_ids[:end + 1]
        assert offset < (len(ids) - 1) // BLOCK * BLOCK < end
        hits = engine.get_stats().prefix_hits
        short = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, greedy(4),
                             use_tqdm=False)[0]
        assert short.num_cached_tokens == offset // BLOCK * BLOCK
        assert engine.get_stats().prefix_hits - hits == short.num_cached_tokens
        t = torch.tensor([ids])
        inputs = {"input_ids": t, "attention_mask": torch.ones_like(t),
                  "token_type_ids": (t == model.config.image_token_id).long(),
                  "pixel_values": processor.image_processor([a], return_tensors="pt")["pixel_values"]}
        assert short.outputs[0].token_ids == hf_greedy(model, inputs, 4)
        assert engine.kv.num_used_blocks == 0
        assert engine.scheduler.encoder_cache.num_referenced_tokens == 0


def test_chat_with_image_parts_matches_hf(hf, llm):
    """``LLM.chat`` with data-URL ``image_url`` parts in two turns: the template's ``<start_of_image>`` per part
    becomes the full image sequence; HF generates the same tokens from the same ids, pixels and token types."""
    from media_server import data_url, png_bytes
    from PIL import Image
    import io

    model, processor = hf
    raw = [png_bytes((30, 50), color=(200, 30, 30)), png_bytes((70, 40), color=(20, 60, 210))]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(raw[0])}},
                                             {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A red square."},
                {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                             {"type": "image_url", "image_url": {"url": data_url(raw[1])}}]}]
    out = llm.chat(messages, greedy(6), use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids])
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in raw]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    image_token = model.config.image_token_id
    assert int((ids == image_token).sum()) == 2 * TOKENS_PER_IMAGE
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
              "token_type_ids": (ids == image_token).long()}
    assert out.outputs[0].token_ids == hf_greedy(model, inputs, 6)


# ---- the contract: reference attention, capability, conformance ---------------------------------------------------
def test_reference_attention_matches_hfs_mask():
    """Core's reference attention with spans against the mask HF builds for Gemma 3 (``blockwise_overlay`` OR-ed
    with causality, then the sliding window), on one prefill chunk."""
    from pagedllm.backend.attention import AttentionMetadata
    from transformers.masking_utils import and_masks, blockwise_overlay, causal_mask_function, or_masks, \
        sliding_window_overlay

    torch.manual_seed(0)
    n, heads, hs = 30, 2, 16
    types = torch.zeros(1, n, dtype=torch.long)
    types[0, 4:20] = 1
    types[0, 23:27] = 1
    blocks = torch.where(types == 1, torch.cumsum((types == 1) & (torch.nn.functional.pad(types, (1, 0))[:, :-1] == 0),
                                                  1) - 1, -1)
    q, k, v = torch.randn(n, heads, hs), torch.randn(n, heads, hs), torch.randn(n, heads, hs)
    cache = torch.zeros(2, 4, 8, heads, hs)
    meta = AttentionMetadata.build([n], [n], [[0, 1, 2, 3]], 8)
    ref_ops.write_kv(k, v, cache, meta.slot_mapping, 1.0, 1.0)
    meta.mm_prefix_ranges = [spans_of(types[0])]
    for window in (None, SLIDING_WINDOW):
        fn = or_masks(causal_mask_function, blockwise_overlay(blocks))
        if window is not None:
            fn = and_masks(fn, sliding_window_overlay(window))
        idx = torch.arange(n)
        mask = torch.tensor([[bool(fn(0, 0, i, j)) for j in idx] for i in idx])
        scores = torch.einsum("lhd,shd->hls", q, k) * hs ** -0.5
        want = torch.einsum("hls,shd->lhd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)
        got = ref_ops.paged_attention(q, cache, meta, hs ** -0.5, window, None, 1.0, 1.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(got, ref_ops.paged_attention(q, cache, replace(meta, mm_prefix_ranges=None),
                                                               hs ** -0.5, window, None, 1.0, 1.0))


def _attention_ignoring_spans(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                              alibi_slopes=None, sinks=None):
    """A plausible bug: the kernel never reads ``meta.mm_prefix_ranges`` (plain causal prefill)."""
    return ref_ops.paged_attention(query, kv_cache, replace(meta, mm_prefix_ranges=None), scale, sliding_window,
                                   soft_cap, k_scale, v_scale, alibi_slopes, sinks)


def test_conformance_checks_the_spans_where_declared():
    from pagedllm.conformance.runner import run_conformance

    def cases(backend):
        report = run_conformance(backend, allow=["paged_attention.mm_prefix.*"], gqa_ratios=(3,))
        return [r for r in report.results if r.kernel.startswith("paged_attention.mm_prefix")]

    from pagedllm.backend.registry import get_backend

    cpu = cases(get_backend("cpu"))
    assert {r.kernel for r in cpu} == {"paged_attention.mm_prefix.prefill", "paged_attention.mm_prefix.mixed",
                                       "paged_attention.mm_prefix.mixed.sliding_window"}
    assert all(r.status == "passing" and not r.fallback for r in cpu), [(r.id, r.error) for r in cpu]
    caps = Capabilities(**REFERENCE_FEATURES, head_sizes=(64,), mm_prefix_lm=True)
    bad = cases(Backend(make_plugin("badspans", caps, paged_attention=_attention_ignoring_spans), "badspans"))
    assert bad and all(r.status == "failing" for r in bad)
    own = cases(Backend(make_plugin("nospans", replace(caps, mm_prefix_lm=False),
                                    paged_attention=ref_ops.paged_attention), "nospans"))
    assert own and all(r.not_applicable and r.error == "capabilities do not declare mm_prefix_lm" for r in own)


def test_a_backend_without_the_capability_refuses_gemma3_vision(model_path):
    from pagedllm.config import EngineConfig, resolve_config
    from pagedllm.errors import ParamError
    from pagedllm.models import load_config
    from pagedllm.models.info import read_model_info

    info = read_model_info(model_path, load_config(model_path))
    assert info.mm_prefix_lm and info.architecture == "Gemma3ForConditionalGeneration"
    assert info.sliding_window == SLIDING_WINDOW
    caps = Capabilities(**REFERENCE_FEATURES, head_sizes=None)
    own = Backend(make_plugin("nospans", caps, paged_attention=ref_ops.paged_attention), "nospans")
    with pytest.raises(ParamError, match=r"^model: Gemma3ForConditionalGeneration attends bidirectionally within "
                                         r"each image .*backend 'nospans' does not support "
                                         r"\(Capabilities\.mm_prefix_lm\)"):
        resolve_config(EngineConfig(), own, info)
    # core's reference attention does the spans: a backend that leaves attention to it is not refused
    ref = Backend(make_plugin("refspans", caps), "refspans")
    assert ref.capabilities.mm_prefix_lm
    resolve_config(EngineConfig(), ref, info)
    resolve_config(EngineConfig(), own, replace(info, mm_prefix_lm=False))
