"""Tiny EAGLE heads in the on-disk layout of the EAGLE repo / vLLM (config.json + model.safetensors with ``fc.weight``
and ``layers.0.*``; layer 0 without ``input_layernorm``), and a dense HF oracle of the head's drafts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from tiny_models import make_tiny_model

_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")


def _target_tensors(target: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(target, "model.safetensors"))


def make_eagle_head(target: str, out_dir: str | os.PathLike, seed: int = 0, copy_layer: bool = False) -> str:
    """A one-layer EAGLE head for ``target`` (a tiny Llama folder). Random (seeded) weights; with ``copy_layer``,
    ``fc = [I, 0]`` (the head reads the token's embedding only) and the target's layer 0 copied."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, architectures=["EagleLlamaForCausalLM"])
    tt = _target_tensors(target)
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {"embed_tokens.weight": tt["model.embed_tokens.weight"].clone()}  # ignored
    if copy_layer:
        t["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        for name in _LAYER:
            t[f"layers.0.{name}"] = tt[f"model.layers.0.{name}"].clone()
    else:
        t["fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
        for name in _LAYER:
            shape = tt[f"model.layers.0.{name}"].shape
            t[f"layers.0.{name}"] = (1 + 0.2 * torch.randn(shape, generator=g) if "norm" in name
                                     else 0.15 * torch.randn(shape, generator=g))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return str(out)


def make_bigram_llama(out_dir: str | os.PathLike, seed: int = 0, o_scale: float = 0.0) -> str:
    """A one-layer tiny Llama with final norm weight one and o_proj scaled by ``o_scale``. At 0 its next token
    depends on the last token only, so an EAGLE head with its layer (``copy_layer``) predicts it exactly; a small
    ``o_scale`` keeps attention (and the K/V cache) in play and makes the head right most of the time."""
    path = make_tiny_model("llama", out_dir, seed=seed, num_hidden_layers=1)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    t["model.layers.0.self_attn.o_proj.weight"].mul_(o_scale)
    t["model.norm.weight"].fill_(1.0)
    save_file(t, f, metadata={"format": "pt"})
    return path


class DenseEagleOracle:
    """HF transformers' Llama modules, dense and uncached: the target's final-normed features, and the head (HF
    ``LlamaModel`` with layer 0's ``input_layernorm`` and the final norm removed) drafting greedily."""

    def __init__(self, target: str, head: str):
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaModel

        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        cfg = AutoConfig.from_pretrained(head)
        self.head = LlamaModel(cfg).eval()
        t = load_file(os.path.join(head, "model.safetensors"))
        sd = {f"layers.0.{n}": t[f"layers.0.{n}"] for n in _LAYER}
        missing, _ = self.head.load_state_dict(sd, strict=False)
        assert set(missing) <= {"embed_tokens.weight", "layers.0.input_layernorm.weight", "norm.weight"}, missing
        self.head.layers[0].input_layernorm = torch.nn.Identity()
        self.head.norm = torch.nn.Identity()
        self.fc = t["fc.weight"]

    @torch.no_grad()
    def drafts(self, tokens: Sequence[int], k: int) -> list[int]:
        """The k greedy drafts after ``tokens`` (features of positions 0..n-2, then the head's own)."""
        ids = torch.tensor([list(tokens)])
        feats = self.target(ids, output_hidden_states=True).hidden_states[-1][0, :-1]  # final-normed
        emb = self.target.model.embed_tokens
        inp = torch.cat([emb(ids[0, 1:]), feats], dim=-1) @ self.fc.T
        out = []
        for _ in range(k):
            h = self.head(inputs_embeds=inp[None]).last_hidden_state[0]
            d = int(self.target.lm_head(h[-1]).argmax())
            out.append(d)
            inp = torch.cat([inp, (torch.cat([emb(torch.tensor([d])), h[-1:]], dim=-1) @ self.fc.T)])
        return out
