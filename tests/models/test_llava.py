"""LLaVA natively (CLIP tower + projector + Llama decoder) against HF transformers on a tiny random checkpoint with
SmolLM2's tokenizer and a PIL-backed processor (tests/support/tiny_vlm.py), images made here with PIL in several
sizes and aspect ratios (the processor resizes and crops each to 84x84: 36 placeholder tokens, over two blocks).

Oracles: HF's processor output (token ids, pixel values), HF's ``get_image_features``, HF's ``generate`` (greedy
tokens) and HF's forward (log-probabilities of every prompt and output token). Engine paths: one and two images per
prompt, chunked prefill splitting an image (``max_num_batched_tokens`` below an image's token count), an encoder
budget of one image per step, prefix-cache hits over an image's blocks (the same pixels) and none past the image's
first block for different pixels, and no reference or block left behind after finishing or aborting.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from pagedllm import LLM
from pagedllm.errors import ParamError
from pagedllm.multimodal.processing import MultiModalProcessor, hash_image
from pagedllm.multimodal.registry import supported_modalities
from tiny_vlm import TOKENS_PER_IMAGE, tiny_llava_model
from vlm_parity import (BLOCK, assert_greedy_and_logprobs_match, assert_text_logits_match, engine_fixture, greedy,
                        hf_fixture, hf_generate, image)

PROMPT_1 = "USER: <image>\nWhat is in the picture? ASSISTANT:"
PROMPT_2 = "USER: compare <image> with <image> please. ASSISTANT:"
IMAGES = {"square": image(84, 84, 0), "wide": image(40, 150, 1), "tall": image(200, 60, 2),
          "small": image(20, 28, 3)}


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_llava_model()


hf = hf_fixture("LlavaForConditionalGeneration")
llm = engine_fixture(96)  # 24 tokens a step: every image (36 tokens) is split across steps


def test_registry_lists_llava_and_processor_matches_hf(model_path, hf):
    from pagedllm.models import load_config

    config = load_config(model_path)
    assert supported_modalities(config) == {"image"}
    _, processor = hf
    ours = MultiModalProcessor(model_path, config)
    images = [IMAGES["wide"], IMAGES["tall"]]
    got = ours(PROMPT_2, None, images)
    want = processor(text=PROMPT_2, images=images, return_tensors="pt")
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    for i, f in enumerate(got.mm_features):
        torch.testing.assert_close(f.data["pixel_values"], want["pixel_values"][i:i + 1], atol=0, rtol=0)
        assert f.mm_position.length == TOKENS_PER_IMAGE
        assert set(got.prompt_token_ids[f.mm_position.offset:f.mm_position.end]) == {ours.image_token_id}
        assert f.identifier == hash_image(images[i])
    assert got.mm_features[1].mm_position.offset > got.mm_features[0].mm_position.end  # text between them
    # token ids with one placeholder per image expand to the same prompt
    ids = processor.tokenizer.encode(PROMPT_2)
    assert ours(None, ids, images).prompt_token_ids == got.prompt_token_ids
    # the hash is of the pixels: an equal copy hashes equal, one changed pixel does not
    copy = images[0].copy()
    assert hash_image(copy) == hash_image(images[0])
    copy.putpixel((0, 0), (1, 2, 3))
    assert hash_image(copy) != hash_image(images[0])
    # palette images: the same indices under another palette are other pixels
    p1 = images[0].convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    p2 = p1.copy()
    p2.putpalette([255 - v for v in p1.getpalette()])
    assert p1.tobytes() == p2.tobytes() and hash_image(p1) != hash_image(p2)


@pytest.mark.parametrize("names", [("square",), ("wide", "tall", "small")])
def test_image_features_match_hf(model_path, hf, llm, names):
    model, processor = hf
    images = [IMAGES[n] for n in names]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=pixels).pooler_output
    got = llm.llm_engine.model.embed_multimodal([{"pixel_values": pixels[i:i + 1]} for i in range(len(images))])
    for a, b in zip(got, want):
        assert a.shape == (TOKENS_PER_IMAGE, 64)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [dict(vision_feature_layer=[-3, -1], vision_feature_select_strategy="full"),
                                       dict(vision_feature_layer=1, projector_hidden_act="silu")])
def test_feature_layers_and_strategies_match_hf(hf, tmp_path, overrides):
    """Several feature layers concatenated (with the CLS row kept), and the first layer's output alone."""
    from pagedllm.backend.registry import get_backend
    from pagedllm.models import load_model
    from transformers import LlavaForConditionalGeneration
    from tiny_vlm import make_llava_variant

    path = make_llava_variant(tmp_path / "variant", **overrides)
    ours = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device="cpu")
    theirs = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = hf[1].image_processor([IMAGES["wide"], IMAGES["small"]], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = theirs.model.get_image_features(pixel_values=pixels).pooler_output
    got = ours.embed_multimodal([{"pixel_values": pixels[i:i + 1]} for i in range(2)])
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_text_logits_match(ours, theirs, [1, 7, 9])


@pytest.mark.parametrize("prompt,names", [(PROMPT_1, ("wide",)), (PROMPT_2, ("tall", "small"))])
def test_greedy_and_logprobs_match_hf_with_chunks_splitting_images(hf, llm, prompt, names):
    model, processor = hf
    images = [IMAGES[n] for n in names]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    prompt_lp = assert_greedy_and_logprobs_match(llm, model, inputs, prompt, images, 10)
    # the images matter: other pixels give other log-probabilities for the tokens after them
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [IMAGES["square"]] * len(images)}},
                         greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    other_lp = [d[t].logprob for d, t in zip(other.prompt_logprobs[1:], other.prompt_token_ids[1:])]
    assert max(abs(a - b) for a, b in zip(other_lp, prompt_lp)) > 1e-3


def test_batch_of_image_and_text_prompts_in_one_engine(hf, llm):
    """Image prompts beside a text-only prompt and a token-id prompt, in one continuous batch: each matches HF."""
    model, processor = hf
    tok = processor.tokenizer
    cases = [(PROMPT_1, [IMAGES["tall"]]), (PROMPT_2, [IMAGES["square"], IMAGES["wide"]]),
             ("USER: just text, no picture. ASSISTANT:", [])]
    prompts, want = [], []
    for text, images in cases:
        if images:
            inputs = processor(text=text, images=images, return_tensors="pt")
            prompts.append({"prompt_token_ids": tok.encode(text), "multi_modal_data": {"image": images}})
        else:
            inputs = {"input_ids": torch.tensor([tok.encode(text)])}
            prompts.append(text)
        want.append(hf_generate(model, inputs, 6))
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefix_cache_reuses_an_images_blocks_and_never_another_images(model_path, hf):
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64,
             num_gpu_blocks_override=64) as llm:
        engine = llm.llm_engine
        runner = engine.worker.runner.encoder_runner
        a, b = IMAGES["wide"], IMAGES["tall"]
        first = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a}}, greedy(4), use_tqdm=False)[0]
        offset = engine.mm_processor(PROMPT_1, None, [a]).mm_features[0].mm_position.offset
        n = len(first.prompt_token_ids)
        assert runner.num_encoded == 1 and engine.get_stats().prefix_hits == 0
        # the same pixels (a copy): every full prompt block is a hit, and the image is not encoded again
        again = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a.copy()}}, greedy(4),
                             use_tqdm=False)[0]
        assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK > offset + TOKENS_PER_IMAGE - BLOCK
        assert engine.get_stats().prefix_hits == again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert runner.num_encoded == 1
        # other pixels behind the same tokens: only the blocks before the image's first one hit
        other = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": b}}, greedy(4), use_tqdm=False)[0]
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.num_cached_tokens == offset // BLOCK * BLOCK
        assert runner.num_encoded == 2
        # A's pixels again, other text after the image: the hit ends inside the image; A's output was evicted from
        # the 64-token encoder cache by B's, so A is encoded again, and the tokens still match HF
        model, processor = hf
        text = PROMPT_1.replace("What is in the picture?", "Describe the colours, please.")
        inputs = processor(text=text, images=[a], return_tensors="pt")
        want = hf_generate(model, inputs, 4)
        mid = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, greedy(4), use_tqdm=False)[0]
        assert offset < mid.num_cached_tokens < offset + TOKENS_PER_IMAGE
        assert runner.num_encoded == 3 and mid.outputs[0].token_ids == want
        # nothing referenced, nothing held once all finished
        assert engine.kv.num_used_blocks == 0
        assert engine.scheduler.encoder_cache.num_referenced_tokens == 0


def test_encoder_budget_of_one_image_per_step_and_abort_leaves_nothing(model_path, hf):
    """An encoder budget of one image: two requests reaching their images in the same step take turns (still
    exact); an abort in the middle of an image's prefill releases its blocks and its cache reference."""
    model, processor = hf
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=128,
             max_num_encoder_input_tokens=TOKENS_PER_IMAGE, num_gpu_blocks_override=64) as llm:
        engine = llm.llm_engine
        assert engine.scheduler.encoder_cache.cache_size == TOKENS_PER_IMAGE
        calls: list[int] = []  # images per encoder call (the real method, recorded)
        encode = engine.model.embed_multimodal
        engine.model.embed_multimodal = lambda items: (calls.append(len(items)), encode(items))[1]
        images = [IMAGES["square"], IMAGES["small"]]
        want = []
        for im in images:
            inputs = processor(text=PROMPT_1, images=[im], return_tensors="pt")
            want.append(hf_generate(model, inputs, 5))
        outs = llm.generate([{"prompt": PROMPT_1, "multi_modal_data": {"image": im}} for im in images], greedy(5),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert calls == [1, 1]  # both reached their image in the first step; the budget took one per step
        # abort mid-image: 24-token chunks stop inside the image
        engine.scheduler.max_num_batched_tokens = 24
        engine.add_request("cut", {"prompt": PROMPT_2, "multi_modal_data": {"image": [IMAGES["tall"],
                                                                                       IMAGES["wide"]]}}, greedy(3))
        engine.step()
        req = engine.requests["cut"][1]
        assert 0 < req.num_computed_tokens < req.mm_features[0].mm_position.end
        assert engine.scheduler.encoder_cache.num_referenced_tokens == TOKENS_PER_IMAGE
        engine.abort_request("cut")
        assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
        assert engine.scheduler.encoder_cache.num_referenced_tokens == 0


@pytest.mark.parametrize("swap_space", [0.0, 0.01])
def test_preemption_with_images_recompute_or_swap(model_path, hf, swap_space):
    """A KV pool too small for three image prompts at once: requests are preempted (recomputed, or swapped out and
    back in the middle of an image) and still match HF; nothing is left referenced."""
    model, processor = hf
    cases = [(PROMPT_1, [IMAGES["wide"]]), (PROMPT_1, [IMAGES["tall"]]), (PROMPT_2, [IMAGES["small"], IMAGES["wide"]])]
    want = []
    for text, images in cases:
        inputs = processor(text=text, images=images, return_tensors="pt")
        want.append(hf_generate(model, inputs, 20))
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_model_len=112,
             max_num_batched_tokens=24, num_gpu_blocks_override=7, swap_space=swap_space) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im}} for t, im in cases], greedy(20),
                            use_tqdm=False)
        engine = llm.llm_engine
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.scheduler.num_preemptions > 0
        assert (engine.scheduler.num_swaps > 0) is (swap_space > 0)
        assert engine.kv.num_used_blocks == 0 and engine.scheduler.encoder_cache.num_referenced_tokens == 0


def test_static_shape_backend_runs_image_steps_eagerly(model_path, hf):
    """``cpu-static`` replays bucket programs over their own metadata (no image rows): steps carrying image rows run
    the model eagerly, text-only steps (the decodes) keep replaying the warmed-up buckets; tokens match HF."""
    model, processor = hf
    inputs = processor(text=PROMPT_2, images=[IMAGES["wide"], IMAGES["square"]], return_tensors="pt")
    want = hf_generate(model, inputs, 8)
    with LLM(model_path, device="cpu-static", dtype="float32", max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=32) as llm:
        stats = llm.llm_engine.worker.graph_stats
        replays = stats["replays"]
        out = llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": [IMAGES["wide"], IMAGES["square"]]}},
                           greedy(8), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert stats["replays"] > replays  # the text-only steps still ran the static programs


def test_bad_image_inputs_are_refused_naming_the_field(llm, tmp_path):
    engine = llm.llm_engine
    with pytest.raises(ParamError, match="multi_modal_data.image"):
        engine.add_request(None, {"prompt": PROMPT_1, "multi_modal_data": {"image": ["not an image"]}}, greedy(1))
    with pytest.raises(ParamError, match="multi_modal_data.audio"):
        engine.add_request(None, {"prompt": PROMPT_1, "multi_modal_data": {"audio": [1.0]}}, greedy(1))
    with pytest.raises(ParamError, match="^prompt:"):  # two images, one placeholder
        engine.add_request(None, PROMPT_1, greedy(1), multi_modal_data={"image": [IMAGES["wide"]] * 2})
    with pytest.raises(ParamError, match="^prompt:"):  # a placeholder without its image
        engine.add_request(None, PROMPT_2, greedy(1), multi_modal_data={"image": IMAGES["wide"]})
    with pytest.raises(ParamError, match="truncate_prompt_tokens"):
        engine.add_request(None, PROMPT_1, greedy(1, truncate_prompt_tokens=8),
                           multi_modal_data={"image": IMAGES["wide"]})
    from pagedllm.sampling_params import BeamSearchParams

    with pytest.raises(ParamError, match="^multi_modal_data:"):  # beam search takes text: refused, never dropped
        llm.beam_search([{"prompt": PROMPT_1, "multi_modal_data": {"image": IMAGES["wide"]}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0


def test_text_only_model_refuses_images(tmp_path):
    from server_utils import tiny_chat_model

    with LLM(tiny_chat_model(), device="cpu", dtype="float32") as llm:
        with pytest.raises(ParamError, match="multi_modal_data: .*takes no images"):
            llm.generate({"prompt": "hello <image>", "multi_modal_data": {"image": IMAGES["wide"]}}, greedy(1),
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
