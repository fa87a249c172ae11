"""A tiny random Gemma 3 with vision (``Gemma3ForConditionalGeneration``: SigLIP tower + ``Gemma3MultiModalProjector``
+ Gemma 3 text decoder) with SmolLM2's real tokenizer plus Gemma 3's image tokens (``<start_of_image>``,
``<image_soft_token>``, ``<end_of_image>``, named on the tokenizer as ``boi_token`` / ``image_token`` /
``eoi_token``, as Gemma 3's tokenizer names them) and a ``Gemma3Processor`` over the PIL image processor, saved as a
HF folder.

The tower sees 32x32 images in 4-pixel patches (8 x 8 patches), average-pooled 2 x 2 to ``mm_tokens_per_image`` 16
soft tokens; the decoder's sliding window (12) is shorter than an image's run of soft tokens, so the bidirectional
image span and the window both shape the sliding layers' mask. Built once per machine into a deterministic cache
folder (seeded weights), like ``tiny_vlm.tiny_llava_model``.
"""

from __future__ import annotations

from server_utils import _smollm2_dir, model_cache_dir, save_atomically
from tiny_vlm import _randomize

_VERSION = "v1"
IMAGE_SIZE = 32
PATCH = 4
TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 12
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
# Gemma-style turns; each {"type": "image"} / image_url part renders one <start_of_image>, which the processor expands
# to "\n\n<start_of_image>" + 16 soft tokens + "<end_of_image>\n\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}"
    "\n{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_vlm_config(vocab_size: int, boi: int, image: int, eoi: int, **text):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH, hidden_act="gelu_pytorch_tanh",
                                layer_norm_eps=1e-6, vision_use_head=False)
    text_config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                                   vocab_size=vocab_size, max_position_embeddings=1024, sliding_window=SLIDING_WINDOW,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rms_norm_eps=1e-6, rope_parameters={
                                       "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                          "factor": 4.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                   **text)
    cfg = Gemma3Config(vision_config=vision.to_dict(), text_config=text_config.to_dict(),
                       mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=boi, eoi_token_index=eoi,
                       image_token_index=image)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


def gemma3_tokenizer():
    """SmolLM2's tokenizer with Gemma 3's image tokens, named as Gemma 3's own tokenizer names them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                        extra_special_tokens=IMAGE_TOKENS)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values()) + ["<start_of_turn>",
                                                                                      "<end_of_turn>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_gemma3_vlm_model() -> str:
    """Path of the tiny random Gemma 3 vision folder (config, safetensors, tokenizer, processor, chat template)."""
    out = model_cache_dir() / f"tiny-gemma3-vlm-{_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = gemma3_tokenizer()
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in IMAGE_TOKENS.items()}
    cfg = gemma3_vlm_config(len(tok), ids["boi_token"], ids["image_token"], ids["eoi_token"],
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    _randomize(model, 1)
    with torch.no_grad():  # _randomize widens the vision tower by name; the projector's parameter too
        for name, p in model.named_parameters():
            if "multi_modal_projector.mm_input_projection" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS_PER_IMAGE,
                                chat_template=CHAT_TEMPLATE)
    return save_atomically(out, "tiny-gemma3-vlm-", model, processor)
