"""Tiny random configs of the native models with recurrent state (issue 28), shared by their model tests
(tests/models/test_lfm2.py, test_qwen3_next.py, test_mamba2.py) and the static-shape backend's state tests
(tests/plugins/cpu/test_static_state.py)."""

from __future__ import annotations

# LFM2: conv, attention, conv, conv, attention; kernel 3, conv biases, GQA 3:1
LFM2_VOCAB = 500
LFM2 = dict(model_type="lfm2", vocab_size=LFM2_VOCAB, hidden_size=96, intermediate_size=144, num_hidden_layers=5,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
            norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, conv_L_cache=3, conv_bias=True,
            block_multiple_of=32, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
            tie_word_embeddings=True)

# Qwen3-Next: Gated DeltaNet (conv kernel 4) and gated attention layers, MoE + shared expert (one dense MLP layer)
QWEN3_NEXT_VOCAB = 500
QWEN3_NEXT = dict(model_type="qwen3_next", vocab_size=QWEN3_NEXT_VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                  linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2], max_position_embeddings=256,
                  initializer_range=0.05, rms_norm_eps=1e-6,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

# Pure Mamba2: 3 layers of 8 heads, 2 groups, SSD chunks of 8 (so prefill chunks cross SSD chunks)
MAMBA2_VOCAB = 300
MAMBA2 = dict(vocab_size=MAMBA2_VOCAB, hidden_size=64, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, model_type="mamba2", num_hidden_layers=3, num_heads=8, head_dim=16, expand=2,
              n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, use_bias=True, use_conv_bias=True,
              tie_word_embeddings=False)
