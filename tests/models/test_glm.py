"""GLM natively (transformers ``Glm``/``Glm4``: partial rotary over interleaved pairs, fused gate_up, Glm4's post
norms) and the remote-code ChatGLM2/3 layout mapped onto Glm by name. Oracles: HF Glm/Glm4 on odd shapes (head 48,
GQA 5:1, vocab 500); ChatGLM: the same weights re-laid from a HF Glm checkpoint, run by HF's Glm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_utils import as_chatglm
from model_parity import assert_engine_parity
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import CausalLM, load_config, load_model
from pagedllm.models.remote_layouts import ChatGLMWeights
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, hf_eager, parity_prompts, run_schedule
from tiny_models import GLM_CONFIGS, make_fallback_model

NAMES = list(GLM_CONFIGS)


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("glm")
    dirs = {name: make_fallback_model(name, root / name) for name in NAMES}
    dirs["chatglm"] = chatglm_from_glm(dirs["glm"], root / "chatglm")
    return dirs


def chatglm_from_glm(glm_dir: str, out: Path, extra: dict = None, **raw_overrides) -> str:
    """Re-lay a HF Glm checkpoint as ChatGLM2/3: q/k/v (and biases) into query_key_value, gate_up_proj as
    dense_h_to_4h, ChatGLM's names and config.json (plus the rotary inv_freq buffer ChatGLM checkpoints carry)."""
    cfg = json.loads((Path(glm_dir) / "config.json").read_text())
    src = load_file(str(Path(glm_dir) / "model.safetensors"))
    sd = {f"transformer.{name}": t for name, t in as_chatglm(src).items()}
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5  # ChatGLM rotates half the head
    rot = cfg["head_dim"] // 2
    sd["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    sd.update(extra or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    raw = dict(architectures=["ChatGLMModel"], model_type="chatglm", padded_vocab_size=cfg["vocab_size"],
               hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
               num_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
               kv_channels=cfg["head_dim"], multi_query_attention=True,
               multi_query_group_num=cfg["num_key_value_heads"], seq_length=cfg["max_position_embeddings"],
               layernorm_epsilon=cfg["rms_norm_eps"], rmsnorm=True, add_bias_linear=False, add_qkv_bias=True,
               apply_residual_connection_post_layernorm=False, post_layer_norm=True, original_rope=True,
               bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"], pad_token_id=cfg["pad_token_id"],
               torch_dtype="float32", auto_map={"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                                                "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration"})
    raw.update(raw_overrides)
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


@pytest.mark.parametrize("name", NAMES + ["chatglm"])
def test_glm_logits_match_hf(glm_dirs, ref_backend, name):
    hf = hf_eager(glm_dirs["glm" if name == "chatglm" else name])
    ours = load_model(glm_dirs[name], backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, CausalLM)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (10, 2, 48)
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NAMES + ["chatglm"])
def test_glm_greedy_parity_engine(glm_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16), chunked prefill, prefix hits."""
    hf = hf_eager(glm_dirs["glm" if name == "chatglm" else name])
    llm = assert_engine_parity(glm_dirs[name], hf)
    assert isinstance(llm.llm_engine.model, CausalLM)


def test_chatglm_mapping_covers_every_tensor(glm_dirs, ref_backend, tmp_path):
    """Every ChatGLM tensor name has a Glm counterpart (the fused q/k/v and gate/up included), and a tensor the
    mapping has no place for is an unknown variant: refused, naming it."""
    names = set(load_file(str(Path(glm_dirs["chatglm"]) / "model.safetensors")))
    config = load_config(glm_dirs["chatglm"])
    with torch.device("meta"):
        from pagedllm.models.arch import architecture_of

        ours = CausalLM(config, architecture_of(config)[1], ref_backend)
    mapped = {ChatGLMWeights.name(("model." if k != "lm_head.weight" else "") + k) for k in ours.state_dict()}
    assert mapped | {"transformer.rotary_pos_emb.inv_freq"} == names
    odd = chatglm_from_glm(glm_dirs["glm"], tmp_path / "odd",
                           extra={"transformer.encoder.layers.0.self_attention.prefix_encoder": torch.ones(3)})
    with pytest.raises(UnsupportedModelError, match="prefix_encoder"):
        load_model(odd, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))


def test_chatglm_v1_and_unmapped_variants_are_refused(glm_dirs, tmp_path):
    raw = json.loads((Path(glm_dirs["chatglm"]) / "config.json").read_text())
    v1 = {k: v for k, v in raw.items() if k not in ("padded_vocab_size", "kv_channels")}
    (tmp_path / "config.json").write_text(json.dumps(v1))
    with pytest.raises(UnsupportedModelError, match="ChatGLMModel.*ChatGLM-6B"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, add_bias_linear=True)))
    with pytest.raises(UnsupportedModelError, match="add_bias_linear"):
        load_config(str(tmp_path))
