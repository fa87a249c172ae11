"""Idefics3 / SmolVLM natively (SigLIP tower + pixel-shuffle connector + Llama decoder) against HF transformers on a
tiny random checkpoint with SmolLM2's tokenizer plus SmolVLM's special tokens and a PIL-backed ``Idefics3Processor``
(tests/support/tiny_smolvlm.py), images made here with PIL in several sizes and aspect ratios: a wide image splits
into 1 x 2 tiles plus the global view, a tall one 2 x 1, a large one (and a small one, upscaled to the 128-pixel
longest edge first) 2 x 2 plus the global view; each image's placeholder range spans its tiles and their row/column
markers.

Oracles: HF's processor (token ids, pixel values, attention masks: HF's own PIL image processor, no torchvision),
HF's ``get_image_features``, HF's ``generate`` (greedy tokens) and HF's forward (log-probabilities of every prompt
and output token). Engine paths: one image split into tiles and two images per prompt, chunked prefill splitting an
image (24-token steps), prefix-cache hits over an image's blocks for the same pixels and none past the image's first
block for other pixels.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.multimodal.registry import processor_class, supported_modalities
from tiny_smolvlm import IMAGE_SEQ_LEN, tiny_smolvlm_model
from vlm_parity import (BLOCK, assert_greedy_and_logprobs_match, assert_text_logits_match, engine_fixture, greedy,
                        hf_fixture, hf_generate, image)

PROMPT_1 = "User: <image> What is in the picture?<end_of_utterance>\nAssistant:"
PROMPT_2 = "User: compare <image> with <image> please.<end_of_utterance>\nAssistant:"
IMAGES = {"wide": image(40, 150, 1), "large": image(200, 180, 2), "small": image(20, 28, 3),
          "tall": image(130, 50, 4)}
TILES = {"wide": 3, "large": 5, "small": 5, "tall": 3}  # rows x cols + the global view


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_smolvlm_model()


hf = hf_fixture("Idefics3ForConditionalGeneration")
llm = engine_fixture(128)


def test_processor_spans_and_tiles_match_hf(model_path, hf):
    from pagedllm.models import load_config

    config = load_config(model_path)
    assert supported_modalities(config) == {"image"}
    _, processor = hf
    ours = processor_class(config)(model_path, config)
    tok = processor.tokenizer
    marker_ids = {tok.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>")}
    for names in (("wide", "large"), ("small", "tall")):
        images = [IMAGES[n] for n in names]
        got = ours(PROMPT_2, None, images)
        want = processor(text=PROMPT_2, images=images, return_tensors="pt")
        assert got.prompt_token_ids == want["input_ids"][0].tolist()
        tile = 0
        for name, f in zip(names, got.mm_features):
            n = TILES[name]
            assert f.data["pixel_values"].shape == (1, n, 3, 64, 64)
            torch.testing.assert_close(f.data["pixel_values"][0], want["pixel_values"][0, tile:tile + n], atol=0,
                                       rtol=0)
            assert bool(want["pixel_attention_mask"][0, tile:tile + n].all())
            tile += n
            span = got.prompt_token_ids[f.mm_position.offset:f.mm_position.end]
            assert span == f.data["span_ids"].tolist()
            assert span.count(ours.image_token_id) == n * IMAGE_SEQ_LEN
            assert span[0] in marker_ids and span[-1] == tok.convert_tokens_to_ids("<fake_token_around_image>")
        # the spans cover every image token of the prompt, and text lies between the two images
        assert sum(f.data["span_ids"].tolist().count(ours.image_token_id) for f in got.mm_features) == \
            got.prompt_token_ids.count(ours.image_token_id)
        assert got.mm_features[1].mm_position.offset > got.mm_features[0].mm_position.end
        # token ids with one <image> per image expand to the same prompt
        assert ours(None, tok.encode(PROMPT_2), images).prompt_token_ids == got.prompt_token_ids


def test_image_features_match_hf(model_path, hf, llm):
    model, processor = hf
    images = [IMAGES["large"], IMAGES["wide"], IMAGES["small"]]
    inputs = processor(text="<image><image><image>", images=images, return_tensors="pt")
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              pixel_attention_mask=inputs["pixel_attention_mask"]).pooler_output[0]
    ours = llm.llm_engine.mm_processor
    items = [f.data for f in ours(PROMPT_1.replace("<image>", "<image><image><image>"), None, images).mm_features]
    got = llm.llm_engine.model.embed_multimodal(items)
    rows = torch.cat([e[d["span_ids"] == ours.image_token_id] for e, d in zip(got, items)])
    assert rows.shape == (sum(TILES[n] for n in ("large", "wide", "small")) * IMAGE_SEQ_LEN, 64)
    torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-5)
    # the marker rows are the markers' token embeddings
    emb = model.get_input_embeddings().weight
    for e, d in zip(got, items):
        text = d["span_ids"] != ours.image_token_id
        torch.testing.assert_close(e[text], emb[d["span_ids"][text]], atol=0, rtol=0)


@pytest.mark.parametrize("prompt,names", [(PROMPT_1, ("large",)), (PROMPT_2, ("wide", "small"))])
def test_greedy_and_logprobs_match_hf_with_chunks_splitting_images(hf, llm, prompt, names):
    model, processor = hf
    images = [IMAGES[n] for n in names]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    assert_greedy_and_logprobs_match(llm, model, inputs, prompt, images, 8)


def test_prefix_cache_reuses_an_images_blocks_and_never_another_images(model_path, hf):
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64,
             num_gpu_blocks_override=64) as llm:
        engine = llm.llm_engine
        runner = engine.worker.runner.encoder_runner
        a = IMAGES["wide"]
        first = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a}}, greedy(4), use_tqdm=False)[0]
        feature = engine.mm_processor(PROMPT_1, None, [a]).mm_features[0]
        offset, end = feature.mm_position.offset, feature.mm_position.end
        n = len(first.prompt_token_ids)
        assert runner.num_encoded == 1 and engine.get_stats().prefix_hits == 0
        again = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a.copy()}}, greedy(4),
                             use_tqdm=False)[0]
        assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK >= end - BLOCK
        assert engine.get_stats().prefix_hits == again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert runner.num_encoded == 1
        # other pixels of the same size: the same prompt tokens, but only the blocks before the image's first hit
        other_image = a.transpose(0)  # (a mirror: the same size and tiles, other pixels)
        other = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": other_image}}, greedy(4),
                             use_tqdm=False)[0]
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.num_cached_tokens == offset // BLOCK * BLOCK
        assert runner.num_encoded == 2
        # HF agrees on the other image's tokens (its blocks were computed afresh)
        model, processor = hf
        inputs = processor(text=PROMPT_1, images=[other_image], return_tensors="pt")
        want = hf_generate(model, inputs, 4)
        assert other.outputs[0].token_ids == want
        assert engine.kv.num_used_blocks == 0
        assert engine.scheduler.encoder_cache.num_referenced_tokens == 0


def test_smolvlm_architecture_loads_and_matches_hf(hf, tmp_path):
    """``SmolVLMForConditionalGeneration`` (transformers' SmolVLM classes, the SmolVLM2 checkpoints' architecture):
    the same tower, connector and decoder; its PIL image processor gives the same tiles as Idefics3's."""
    from pagedllm.backend.registry import get_backend
    from pagedllm.models import load_model
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    model, processor = hf
    cfg = SmolVLMConfig(**{k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")})
    cfg.architectures = ["SmolVLMForConditionalGeneration"]
    torch.manual_seed(3)
    theirs = SmolVLMForConditionalGeneration(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    theirs.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), backend=get_backend("cpu"), dtype=torch.float32, device="cpu")
    images = [IMAGES["tall"], IMAGES["large"]]
    smol = SmolVLMImageProcessorPil(size={"longest_edge": 128}, max_image_size={"longest_edge": 64})
    pixels = smol(images, return_tensors="pt")
    want_pixels = processor.image_processor(images, return_tensors="pt")
    torch.testing.assert_close(pixels["pixel_values"], want_pixels["pixel_values"], atol=0, rtol=0)
    with torch.no_grad():
        want = theirs.model.get_image_features(pixel_values=pixels["pixel_values"],
                                               pixel_attention_mask=pixels["pixel_attention_mask"]).pooler_output[0]
    torch.testing.assert_close(ours.image_features(pixels["pixel_values"][0]).reshape(-1, 64), want, atol=1e-5,
                               rtol=1e-5)
    assert_text_logits_match(ours, theirs, [1, 7, 9, 11])


def test_chat_with_images_in_two_turns_matches_hf(hf, llm):
    """``LLM.chat`` with ``image_url`` data-URL parts in two user turns: the chat template's one ``<image>`` per part
    becomes each image's tiles and markers (the rendered token ids expanded here), and the tokens are HF's on the
    same rendered text."""
    import base64
    import io

    model, processor = hf

    def data_url(im) -> str:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    a, b = IMAGES["tall"], IMAGES["wide"]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(a)}},
                                             {"type": "text", "text": "What is this?"}]},
                {"role": "assistant", "content": "A gradient."},
                {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                             {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    out = llm.chat(messages, greedy(6), use_tqdm=False)[0]
    hf_messages = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
                   if isinstance(m["content"], list) else m for m in messages]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[a, b], return_tensors="pt", add_special_tokens=False)
    want = hf_generate(model, inputs, 6)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want


def test_placeholders_and_images_that_do_not_match_are_refused(llm, hf):
    from pagedllm.errors import ParamError

    engine = llm.llm_engine
    tok = hf[1].tokenizer
    with pytest.raises(ParamError, match="^prompt:"):  # two images, one placeholder
        engine.add_request(None, PROMPT_1, greedy(1), multi_modal_data={"image": [IMAGES["wide"]] * 2})
    with pytest.raises(ParamError, match="^prompt:"):  # a placeholder without its image
        engine.add_request(None, PROMPT_2, greedy(1), multi_modal_data={"image": IMAGES["wide"]})
    with pytest.raises(ParamError, match="^prompt_token_ids:"):  # token ids: one image token for two images
        engine.add_request(None, {"prompt_token_ids": tok.encode(PROMPT_1)}, greedy(1),
                           multi_modal_data={"image": [IMAGES["wide"], IMAGES["tall"]]})
    with pytest.raises(ParamError, match="^prompt_token_ids:"):  # token ids: the image's span cut short
        got = engine.mm_processor(PROMPT_1, None, [IMAGES["wide"]])
        ids, cut = got.prompt_token_ids, got.mm_features[0].mm_position.offset + 20
        engine.add_request(None, {"prompt_token_ids": ids[:cut] + ids[cut + 1:]}, greedy(1),
                           multi_modal_data={"image": IMAGES["wide"]})
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0
