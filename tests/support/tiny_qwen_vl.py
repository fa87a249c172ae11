"""A tiny random Qwen2-VL (``Qwen2VLForConditionalGeneration``: the ViT with 2-D rotary and patch merger + the Qwen2
decoder with M-RoPE) or Qwen2.5-VL (its tower with RMSNorms, a gated MLP and window attention: 2x2-token windows,
the middle of three blocks full attention) with SmolLM2's real tokenizer plus Qwen's vision tokens and ``Qwen2VLImageProcessorPil``,
saved as a HF folder: the tokenizer (with the chat template) and the PIL image processor (``Qwen2VLProcessor`` itself
needs torchvision's video processor, which does not import here).

The image processor keeps each image's aspect ratio: 14-pixel patches merged 2x2, so an image of HxW pixels
(rounded to multiples of 28, clamped to ``MIN_PIXELS..MAX_PIXELS``) is ``(H/28) * (W/28)`` placeholder tokens. Built
once per machine into a deterministic cache folder (seeded weights), like ``tiny_vlm.tiny_llava_model``.
"""

from __future__ import annotations

from server_utils import _smollm2_dir, model_cache_dir, save_atomically

_VERSION = "v1"
PATCH = 14
MERGE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 40
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML with image parts (HF's convention, as Qwen2-VL's template takes them).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
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
            elif "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "visual" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def qwen_vl_config(family: str, vocab_size: int, token_ids: dict[str, int], special: dict[str, int]):
    """``family``: "qwen2_vl" or "qwen2_5_vl"."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=2, hidden_act="quick_gelu")
    else:
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, hidden_act="silu",
                      window_size=2 * PATCH * MERGE, fullatt_block_indexes=[1])
    # head_dim 32 -> 16 rotary frequencies split 4 (temporal) + 6 (height) + 6 (width)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.15,
                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": [4, 6, 6]}, **special)
    cls = Qwen2VLConfig if family == "qwen2_vl" else Qwen2_5_VLConfig
    return cls(vision_config=vision, text_config=text, image_token_id=token_ids["<|image_pad|>"],
                         video_token_id=token_ids["<|video_pad|>"],
                         vision_start_token_id=token_ids["<|vision_start|>"],
                         vision_end_token_id=token_ids["<|vision_end|>"], tie_word_embeddings=False, **special)


def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                    patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)


def tiny_qwen_vl_model(family: str = "qwen2_vl") -> str:
    """Path of the tiny random Qwen2-VL (or ``"qwen2_5_vl"``: Qwen2.5-VL) folder (config, safetensors, tokenizer,
    image processor, chat template)."""
    out = model_cache_dir() / f"tiny-{family.replace('_', '-')}-{_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    special = {name: getattr(tok, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = qwen_vl_config(family, len(tok), {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}, special)
    torch.manual_seed(0)
    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = cls(cfg).to(torch.float32)
    _randomize(model, 1)
    # (Qwen2VLProcessor itself is built only beside torchvision's video processor)
    return save_atomically(out, f"tiny-{family}-", model, tok, image_processor())
