"""A tiny random LLaVA (``LlavaForConditionalGeneration``: CLIP vision tower + projector + Llama decoder) with
SmolLM2's real tokenizer plus an added ``<image>`` token and a PIL-backed ``LlavaProcessor``, saved as a HF folder.

The vision tower sees 84x84 images in 14-pixel patches: 36 patches + CLS; the "default" feature strategy drops the
CLS row, so each image is 36 ``<image>`` tokens in the prompt (more than two blocks of 16). Built once per machine
into a deterministic cache folder (seeded weights), like ``server_utils.tiny_chat_model``.
"""

from __future__ import annotations

from server_utils import _smollm2_dir, model_cache_dir, save_atomically

_VERSION = "v2"
IMAGE_SIZE = 84
PATCH = 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2


# ChatML with image parts (HF's convention, as llava-hf templates take them): each {"type": "image"} entry renders one
# ``<image>`` placeholder, which the processor expands to TOKENS_PER_IMAGE tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _randomize(model, seed: int) -> None:
    """Wider weights than HF's init, and random norms and biases, so a wrong mapping of any tensor shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "vision_tower" in name or "projector" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def llava_config(vocab_size: int, image_token_id: int, **overrides):
    """The tiny LLaVA config (``overrides``: LlavaConfig fields such as ``vision_feature_layer``)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32, hidden_act="quick_gelu")
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=512,
                       tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)
    kwargs = dict(image_token_index=image_token_id, image_seq_length=TOKENS_PER_IMAGE, vision_feature_layer=-2,
                  vision_feature_select_strategy="default", projector_hidden_act="gelu")
    return LlavaConfig(vision_config=vision, text_config=text, **{**kwargs, **overrides})


def make_llava_variant(out_dir, seed: int = 0, **overrides) -> str:
    """A tiny random LLaVA without tokenizer or processor (vocabulary 512, image token 500): weights and config
    only, for feature-layer variants."""
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config(512, 500, **overrides)).to(torch.float32)
    _randomize(model, seed + 1)
    model.save_pretrained(out_dir)
    return str(out_dir)


def tiny_llava_model() -> str:
    """Path of the tiny random LLaVA folder (config, safetensors, tokenizer, processor, a chat template taking image
    parts)."""
    out = model_cache_dir() / f"tiny-llava-{_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    cfg = llava_config(len(tok), tok.convert_tokens_to_ids("<image>"))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg.text_config, name, getattr(tok, name))
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    _randomize(model, 1)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    return save_atomically(out, "tiny-llava-", model, processor)
