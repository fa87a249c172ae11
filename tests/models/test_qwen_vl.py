"""Qwen2-VL and Qwen2.5-VL natively (ViT with 2-D rotary + patch merger, 2.5's with window attention; Qwen2 decoder
with M-RoPE) against HF transformers on tiny random checkpoints with SmolLM2's tokenizer and HF's PIL image processor (tests/support/tiny_qwen_vl.py), images
made here with PIL in several sizes and aspect ratios (each keeps its aspect: 4 to 36 placeholder tokens).

Oracles: HF's ``Qwen2VLImageProcessorPil`` tensors and ``Qwen2VLProcessor``'s placeholder expansion (the text with
each ``<|image_pad|>`` repeated, tokenized), HF's ``get_rope_index`` (3-D positions and decode delta), HF's
``get_image_features``, HF's ``generate`` (greedy tokens) and HF's forward (log-probabilities of every prompt and
output token). Engine paths: one and two images of different sizes, chunked prefill splitting an image
(``max_num_batched_tokens`` below an image's token count), images beside a text-only prompt in one batch,
prefix-cache hits over an image's blocks (the same pixels) and none past the image's first block for other pixels,
``LLM.chat`` with image parts, the static-shape backend (decodes replay buckets at diagonal positions), preemption
by recompute, and placeholder errors naming the field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pagedllm import LLM
from pagedllm.errors import ParamError
from pagedllm.models import load_config
from pagedllm.multimodal.mrope import step_mrope_positions
from pagedllm.multimodal.processing import hash_image
from pagedllm.multimodal.qwen_vl import QwenVLProcessor
from pagedllm.multimodal.registry import supported_modalities
from tiny_qwen_vl import image_processor, tiny_qwen_vl_model
import vlm_parity
from vlm_parity import BLOCK, engine_fixture, greedy, image

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT_1 = f"USER: {IMG}\nWhat is in the picture? ASSISTANT:"
PROMPT_2 = f"USER: compare {IMG} with {IMG} please. ASSISTANT:"


# wide: 36 tokens (4x9 merged patches), tall: 21 (7x3), small: scaled up to 2x3, big: scaled down to the pixel cap
IMAGES = {"wide": image(100, 260, 1), "tall": image(200, 90, 2), "small": image(20, 28, 3),
          "big": image(300, 310, 4), "wide2": image(100, 260, 5)}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model_path(request) -> str:
    return tiny_qwen_vl_model(request.param)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


llm = engine_fixture(96)  # 24 tokens a step: the 36-token image is split across steps


def hf_inputs(hf, prompt: str, images: list) -> dict:
    """What ``Qwen2VLProcessor`` gives (it needs torchvision here, so its two steps): HF's image processor tensors,
    and the text with each placeholder repeated ``t * h * w / 4`` times, tokenized."""
    _, tok = hf
    out = image_processor()(images, return_tensors="pt")
    parts = prompt.split("<|image_pad|>")
    text = parts[0]
    for grid, rest in zip(out["image_grid_thw"], parts[1:]):
        text += "<|image_pad|>" * (int(grid.prod()) // 4) + rest
    ids = torch.tensor([tok(text)["input_ids"]])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": (ids == image_id).int()}


def hf_generate(hf, inputs: dict, n: int) -> list[int]:
    return vlm_parity.hf_generate(hf[0], inputs, n)


def test_processor_and_mrope_positions_match_hf(model_path, hf):
    config = load_config(model_path)
    assert supported_modalities(config) == {"image"}
    ours = QwenVLProcessor(model_path, config)
    for names in (("wide", "tall"), ("small", "big")):
        images = [IMAGES[n] for n in names]
        got = ours(PROMPT_2, None, images)
        want = hf_inputs(hf, PROMPT_2, images)
        assert got.prompt_token_ids == want["input_ids"][0].tolist()
        torch.testing.assert_close(torch.cat([f.data["pixel_values"] for f in got.mm_features]),
                                   want["pixel_values"], atol=0, rtol=0)
        grids = want["image_grid_thw"]
        for i, f in enumerate(got.mm_features):
            assert f.data["image_grid_thw"].tolist() == grids[i:i + 1].tolist()
            assert f.mm_position.length == int(grids[i].prod()) // 4
            assert set(got.prompt_token_ids[f.mm_position.offset:f.mm_position.end]) == {ours.image_token_id}
            assert f.identifier == hash_image(images[i])
        # token ids with one placeholder per image expand to the same prompt
        ids = hf[1](PROMPT_2)["input_ids"]
        assert ours(None, ids, images).prompt_token_ids == got.prompt_token_ids
        # 3-D positions and the decode delta: HF's get_rope_index
        pos, delta = ours.mrope_positions(len(got.prompt_token_ids), got.mm_features)
        ref, ref_delta = hf[0].model.get_rope_index(want["input_ids"], want["mm_token_type_ids"], grids)
        assert (pos == ref[:, 0].numpy()).all() and delta == int(ref_delta) < 0
    assert [f.mm_position.length for f in ours(PROMPT_2, None, [IMAGES["wide"], IMAGES["small"]]).mm_features] == [
        36, 6]  # the small image is scaled up to the pixel floor
    # a step's slice: prompt rows from the table, rows past the prompt on the diagonal at index + delta
    req = type("R", (), {"mrope_positions": (pos, delta)})()
    n = pos.shape[1]
    idx = np.array([0, got.mm_features[0].mm_position.end - 1, n - 1, n, n + 3])  # the second: an image's last
    diag, three = step_mrope_positions([req], idx, np.zeros(5, dtype=np.int64))
    assert three is not None and (three[:, :3] == pos[:, idx[:3]]).all()
    assert (three[:, 3:] == (idx[3:] + delta)[None]).all() and (diag == three[0]).all()
    text_only = step_mrope_positions([type("R", (), {"mrope_positions": None})()], idx, np.zeros(5, np.int64))
    assert (text_only[0] == idx).all() and text_only[1] is None


def test_image_features_match_hf(hf, llm):
    images = [IMAGES["wide"], IMAGES["tall"], IMAGES["small"]]
    inputs = hf_inputs(hf, f"{IMG}{IMG}{IMG}", images)
    with torch.no_grad():
        want = hf[0].model.get_image_features(pixel_values=inputs["pixel_values"],
                                              image_grid_thw=inputs["image_grid_thw"]).pooler_output
    feats = llm.llm_engine.mm_processor(f"{IMG}{IMG}{IMG}", None, images).mm_features
    got = llm.llm_engine.model.embed_multimodal([f.data for f in feats])
    assert [g.shape for g in got] == [(36, 64), (21, 64), (6, 64)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def hf_logprobs(hf, inputs: dict, tokens: list[int]) -> torch.Tensor:
    """HF's log-probability of each token of ``tokens`` (the processed prompt plus the generated ones) given those
    before it, under the same pixels."""
    ids = torch.tensor([tokens])
    tt = torch.zeros_like(ids)
    tt[0, :inputs["input_ids"].shape[1]] = inputs["mm_token_type_ids"][0]
    with torch.no_grad():
        logits = hf[0](input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       mm_token_type_ids=tt).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), ids[0, 1:]]


@pytest.mark.parametrize("prompt,names", [(PROMPT_1, ("wide",)), (PROMPT_2, ("tall", "big"))])
def test_greedy_and_logprobs_match_hf_with_chunks_splitting_images(hf, llm, prompt, names):
    images = [IMAGES[n] for n in names]
    inputs = hf_inputs(hf, prompt, images)
    want = hf_generate(hf, inputs, 10)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": list(images)}},
                       greedy(10, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want
    assert len(set(want)) > 2  # not a degenerate repetition: the positions after the image matter
    ref = hf_logprobs(hf, inputs, out.prompt_token_ids + want)
    prompt_lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    out_lp = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, want)]
    torch.testing.assert_close(torch.tensor(prompt_lp + out_lp), ref, atol=1e-4, rtol=1e-4)
    # the images matter: other pixels of the same sizes give other log-probabilities for the tokens after them
    others = [im.transpose(Image.Transpose.ROTATE_180) for im in images]
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": others}},
                         greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    assert other.prompt_token_ids == out.prompt_token_ids
    other_lp = [d[t].logprob for d, t in zip(other.prompt_logprobs[1:], other.prompt_token_ids[1:])]
    assert max(abs(a - b) for a, b in zip(other_lp, prompt_lp)) > 1e-3


def test_batch_of_image_and_text_prompts_in_one_engine(hf, llm):
    """Image prompts (text and token ids) beside a text-only prompt, in one continuous batch: each matches HF."""
    tok = hf[1]
    cases = [(PROMPT_1, [IMAGES["tall"]]), (PROMPT_2, [IMAGES["small"], IMAGES["wide"]]),
             ("USER: just text, no picture. ASSISTANT:", [])]
    prompts, want = [], []
    for text, images in cases:
        if images:
            inputs = hf_inputs(hf, text, images)
            prompts.append({"prompt_token_ids": tok(text)["input_ids"], "multi_modal_data": {"image": images}})
        else:
            ids = torch.tensor([tok(text)["input_ids"]])
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            prompts.append(text)
        want.append(hf_generate(hf, inputs, 6))
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_prefix_cache_reuses_an_images_blocks_and_never_another_images(model_path, hf):
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=64,
             num_gpu_blocks_override=64) as llm:
        engine = llm.llm_engine
        runner = engine.worker.runner.encoder_runner
        a, b = IMAGES["wide"], IMAGES["wide2"]  # the same size (36 tokens), other pixels
        first = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a}}, greedy(4), use_tqdm=False)[0]
        offset = engine.mm_processor(PROMPT_1, None, [a]).mm_features[0].mm_position.offset
        n = len(first.prompt_token_ids)
        assert runner.num_encoded == 1 and engine.get_stats().prefix_hits == 0
        # the same pixels (a copy): every full prompt block is a hit, and the image is not encoded again
        again = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": a.copy()}}, greedy(4),
                             use_tqdm=False)[0]
        assert again.num_cached_tokens == (n - 1) // BLOCK * BLOCK > offset + 36 - BLOCK
        assert engine.get_stats().prefix_hits == again.num_cached_tokens
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert runner.num_encoded == 1
        # other pixels behind the same tokens: only the blocks before the image's first one hit; still HF's tokens
        other = llm.generate({"prompt": PROMPT_1, "multi_modal_data": {"image": b}}, greedy(4), use_tqdm=False)[0]
        assert other.prompt_token_ids == first.prompt_token_ids
        assert other.num_cached_tokens == offset // BLOCK * BLOCK
        assert runner.num_encoded == 2
        assert other.outputs[0].token_ids == hf_generate(hf, hf_inputs(hf, PROMPT_1, [b]), 4)
        assert engine.kv.num_used_blocks == 0
        assert engine.scheduler.encoder_cache.num_referenced_tokens == 0


def test_chat_with_image_parts_matches_generate_and_hf(hf, llm):
    """``LLM.chat`` with an image part: the chat template renders Qwen's placeholder, the engine expands it; the
    tokens are HF's."""
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES["tall"]},
                                             {"type": "text", "text": "What is shown?"}]}]
    out = llm.chat(messages, greedy(6), use_tqdm=False)[0]
    text = hf[1].apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": "What is shown?"}]}],
                                     tokenize=False, add_generation_prompt=True)
    inputs = hf_inputs(hf, text, [IMAGES["tall"]])
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == hf_generate(hf, inputs, 6)


def test_static_shape_backend_runs_image_steps_eagerly(model_path, hf):
    """``cpu-static``: steps with image rows (and 3-D positions) run eagerly, the decodes replay the buckets at
    their diagonal positions (``index + delta``); tokens match HF."""
    images = [IMAGES["wide"], IMAGES["small"]]
    want = hf_generate(hf, hf_inputs(hf, PROMPT_2, images), 8)
    with LLM(model_path, device="cpu-static", dtype="float32", max_model_len=128, max_num_seqs=2,
             max_num_batched_tokens=32) as llm:
        stats = llm.llm_engine.worker.graph_stats
        replays = stats["replays"]
        out = llm.generate({"prompt": PROMPT_2, "multi_modal_data": {"image": images}}, greedy(8),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert stats["replays"] > replays


def test_bad_placeholders_are_refused_naming_the_field(llm):
    engine = llm.llm_engine
    with pytest.raises(ParamError, match="^prompt:"):  # two images, one placeholder
        engine.add_request(None, PROMPT_1, greedy(1), multi_modal_data={"image": [IMAGES["wide"]] * 2})
    with pytest.raises(ParamError, match="^prompt_token_ids:"):  # a placeholder without its image
        engine.add_request(None, {"prompt_token_ids": llm.get_tokenizer()(PROMPT_2)["input_ids"]}, greedy(1),
                           multi_modal_data={"image": IMAGES["wide"]})
    assert not engine.has_unfinished_requests() and engine.kv.num_used_blocks == 0


def test_preemption_recomputes_with_the_same_positions(model_path, hf):
    """A KV pool too small for three image prompts at once: requests are preempted and recomputed (their 3-D
    positions and decode delta are the request's, so the recompute is exact); nothing is left referenced."""
    cases = [(PROMPT_1, [IMAGES["wide"]]), (PROMPT_1, [IMAGES["tall"]]), (PROMPT_2, [IMAGES["small"], IMAGES["wide"]])]
    want = [hf_generate(hf, hf_inputs(hf, t, im), 20) for t, im in cases]
    with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_model_len=112,
             max_num_batched_tokens=24, num_gpu_blocks_override=7) as llm:
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": im}} for t, im in cases], greedy(20),
                            use_tqdm=False)
        engine = llm.llm_engine
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.num_used_blocks == 0 and engine.scheduler.encoder_cache.num_referenced_tokens == 0
