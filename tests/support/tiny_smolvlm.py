"""A tiny random Idefics3 / SmolVLM (``Idefics3ForConditionalGeneration``: SigLIP tower + pixel-shuffle connector +
Llama decoder) with SmolLM2's real tokenizer plus the special tokens SmolVLM adds (``<fake_token_around_image>``,
``<image>``, ``<global-img>``, ``<row_r_col_c>``, ``<end_of_utterance>``) and an ``Idefics3Processor`` over the PIL
image processor, saved as a HF folder.

Tiles are 64x64 in 8-pixel patches (64 patches), pixel-shuffled by 2 to 16 image tokens per tile; the processor
resizes the longest edge to 128, so an image is up to 2 x 2 tiles plus the global view (over 80 tokens with markers).
Built once per machine into a deterministic cache folder (seeded weights), like ``tiny_vlm.tiny_llava_model``.
"""

from __future__ import annotations

from server_utils import _smollm2_dir, model_cache_dir, save_atomically
from tiny_vlm import _randomize

_VERSION = "v1"
TILE = 64
PATCH = 8
SCALE = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE ** 2
SPECIAL_TOKENS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                  + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}:{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def idefics3_config(vocab_size: int, image_token_id: int, **text):
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=TILE, patch_size=PATCH, hidden_act="gelu_pytorch_tanh")
    text_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=1024,
                              tie_word_embeddings=False, rms_norm_eps=1e-6, **text)
    cfg = Idefics3Config(vision_config=vision.to_dict(), text_config=text_config.to_dict(), scale_factor=SCALE,
                         image_token_id=image_token_id, tie_word_embeddings=False)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    return cfg


def tiny_smolvlm_model() -> str:
    """Path of the tiny random Idefics3 folder (config, safetensors, tokenizer, processor, chat template)."""
    out = model_cache_dir() / f"tiny-smolvlm-{_VERSION}"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    cfg = idefics3_config(len(tok), tok.convert_tokens_to_ids("<image>"), bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    _randomize(model, 1)
    with torch.no_grad():  # _randomize widens the vision tower by name; the connector too
        for name, p in model.named_parameters():
            if "vision_model" in name and "norm" not in name and not name.endswith("bias") or "connector" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=IMAGE_SEQ_LEN,
                                  chat_template=CHAT_TEMPLATE)
    return save_atomically(out, "tiny-smolvlm-", model, processor)
