"""``pagedllm bench random-model``: write a seeded random model of a realistic shape as a Hugging Face folder, so any
engine (pagedllm, HF transformers, vLLM) can be benchmarked on the same weights without a download.

The folder holds ``config.json``, safetensors in the chosen dtype and the embedded SmolLM2 tokenizer (vocabulary
49,152: every preset uses it, so prompts tokenize and servers start). Weights are HF's own initialisation under
``torch.manual_seed(seed)``: the same command writes the same bytes. Presets name the shape they copy; the hybrid
ones are scaled-down shapes of their family (say so beside any figure), chosen so a 2-core CPU runs them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from pagedllm.bench.mm_throughput import VLM_PRESETS, write_random_vlm

VOCAB = 49152
_LLAMA_1_7B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192, rope_theta=130000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)
#: name -> (what its shape is, HF config fields)
PRESETS: dict[str, tuple[str, dict]] = {
    "smollm2-1.7b": ("SmolLM2-1.7B's shape (issue 32's workload)", _LLAMA_1_7B),
    "gemma3-1b": ("Gemma-3-1B's shape (26 layers: 5 sliding-window (512) per global, 1 KV head of 256)",
                  dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                       query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
                       tie_word_embeddings=True)),
    "lfm2-350m": ("LFM2-350M's shape (10 conv + 6 attention layers)",
                  dict(model_type="lfm2", hidden_size=1024, intermediate_size=6656, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=32768,
                       norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_multiple_of=256,
                       block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                       layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv",
                                    "conv", "full_attention", "conv", "full_attention", "conv", "full_attention",
                                    "conv", "full_attention", "conv"], tie_word_embeddings=True)),
    "mamba2-130m": ("mamba2-130m's shape (24 Mamba2 layers)",
                    dict(model_type="mamba2", hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
                         expand=2, n_groups=1, state_size=128, conv_kernel=4, chunk_size=256,
                         tie_word_embeddings=True)),
    "granite-4.0-h-small-scaled": ("Granite-4.0-H's layout scaled down (hidden 768, 16 layers: 3 Mamba2 per "
                                   "attention layer, 16 experts top-4 + shared MLP)",
                                   dict(model_type="granitemoehybrid", hidden_size=768, intermediate_size=256,
                                        shared_intermediate_size=1024, num_hidden_layers=16, num_attention_heads=12,
                                        num_key_value_heads=4, layer_types=(["mamba"] * 3 + ["attention"]) * 4,
                                        mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                                        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, num_local_experts=16,
                                        num_experts_per_tok=4, embedding_multiplier=12.0, residual_multiplier=0.22,
                                        attention_multiplier=0.0078125, logits_scaling=6.0,
                                        position_embedding_type=None, max_position_embeddings=32768,
                                        tie_word_embeddings=True)),
    "qwen3-next-scaled": ("Qwen3-Next's layout scaled down (hidden 1024, 12 layers: 3 Gated DeltaNet per gated "
                          "attention layer, 32 experts top-4 + shared expert)",
                          dict(model_type="qwen3_next", hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_conv_kernel_dim=4,
                               linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8,
                               linear_num_value_heads=16, moe_intermediate_size=256,
                               shared_expert_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                               max_position_embeddings=32768, rms_norm_eps=1e-6,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3,
                               tie_word_embeddings=False)),
}


def add_parser(sub) -> None:
    p = sub.add_parser("random-model", help="write a seeded random model of a realistic shape (a preset) as a HF "
                                            "folder with the embedded SmolLM2 tokenizer")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS) + sorted(VLM_PRESETS),
                   help="a text model's shape, or a vision-language one (LLaVA-style: bench/mm_throughput.py)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def write_random_model(preset: str, out: str, dtype: str = "bfloat16", seed: int = 0) -> str:
    """Write ``preset`` to ``out`` (a new folder) and return it."""
    import torch  # heavy: not at CLI start
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

    from pagedllm.models.paths import default_model_path  # the embedded SmolLM2 GGUF: its tokenizer

    if preset in VLM_PRESETS:
        return write_random_vlm(preset, out, dtype, seed)
    if os.path.exists(out):
        raise SystemExit(f"--out: {out} exists; give a new folder")
    kwargs = dict(PRESETS[preset][1])
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path()),
                                        gguf_file=os.path.basename(default_model_path()))
    config = AutoConfig.for_model(kwargs.pop("model_type"), vocab_size=VOCAB, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    tmp = tempfile.mkdtemp(prefix=".random-model-", dir=os.path.dirname(os.path.abspath(out)) or ".")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "random_model.json"), "w") as f:  # how it was made, for whoever reads figures
            json.dump({"preset": preset, "shape": PRESETS[preset][0], "dtype": dtype, "seed": seed,
                       "parameters": sum(p.numel() for p in model.parameters())}, f, indent=1)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(args) -> int:
    out = write_random_model(args.preset, args.out, args.dtype, args.seed)
    with open(os.path.join(out, "random_model.json")) as f:
        info = json.load(f)
    print(f"{out}: {info['shape']}, {info['parameters'] / 1e6:.0f}M parameters, {args.dtype}, seed {args.seed}")
    return 0
