"""What the transformers fallback refuses, and why: every rule in one place, each naming the feature it detects.

The fallback runs HF's module with the paged KV cache as the only state and pagedllm's attention (causal, an optional
sliding window, soft-capping, a scale) in place of HF's. A model that keeps any other state, or asks its attention for
anything else, would run silently wrong (issue 28: GPT-OSS's sinks, LFM2's convolution state), so it is refused at
start-up with ``UnsupportedModelError``, in three passes that look for the *feature*, not the architecture's name:

1. ``check_config`` (before any weight is read): encoder-decoder; layer kinds other than full/sliding attention
   (transformers' own ``get_layer_types_and_kwargs``: ``conv``, ``mamba``, ``linear_attention``, ``chunked_attention``,
   ...); KV shared between layers; multi-head latent attention; logit scales the fallback does not apply.
2. ``check_modules`` (the module built on the meta device, still before weights): state-keeping mixers (causal
   ``nn.Conv1d``, Mamba, recurrent, RWKV, xLSTM, linear attention, DeltaNet), attention sinks (parameters).
3. ``probe`` (weights loaded, a few tokens through the model with a recording attention): each decoder layer must
   attend exactly once, under its own ``layer_idx``, with key/value shapes the paged cache holds, and no argument the
   paged attention ignores (``s_aux``: sinks); the mask HF builds for each layer (read from HF's own mask function,
   registered for the probe only) must be the causal mask or the sliding window the layer passes; and the model's
   own logits must equal ``lm_head`` of the decoder's output, which catches any multiplier or transform the
   ``*ForCausalLM`` head applies (Granite's ``logits_scaling``, Cohere's ``logit_scale``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError

#: Layer kinds the paged KV cache holds (transformers' ``layer_types`` vocabulary); ``dummy`` is a layer with no
#: attention and no state (``moe`` / ``mlp`` layer types). Anything else keeps state the fallback does not carry.
PAGED_LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")
#: Config fields that scale logits after ``lm_head`` (the probe catches them too; this names the field up front).
LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
#: Module class-name fragments of mixers that keep a recurrent or convolution state between steps.
STATEFUL_MIXERS = ("mamba", "recurrent", "rwkv", "lstm", "deltanet", "linearattention", "shortconv",
                   "retention", "hyena", "lightningattention")
#: Why a layer kind of ``layer_types`` cannot be paged (others: "a cache the paged KV cache does not hold").
_LAYER_KIND = {"conv": "a convolution state", "chunked_attention": "chunked attention (config.attention_chunk_size)",
               "mamba": "a recurrent (SSM) state", "linear_attention": "a linear-attention state",
               "hybrid": "a recurrent state beside attention", "hybrid_sliding": "a recurrent state beside attention"}
#: Attention-function keyword arguments the paged attention applies, or that carry nothing attention needs.
HANDLED_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "pagedllm", "position_ids",
                            "cache_position", "position_embeddings", "output_attentions", "use_cache", "is_causal",
                            "past_key_values", "past_key_value", "layer_idx", "attention_mask",
                            "return_dict", "head_mask"})
_PROBE_TOKENS = 6
_FAR = 1 << 16  # the query position the probe reads HF's mask function at


class MissingPagedContext(RuntimeError):
    """The attention function was called without the step's context: the module drops the caller's arguments."""


def _refuse(arch: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{arch}: {why}; the transformers fallback cannot run it correctly (it caches only "
                                 "attention K/V in the paged cache and applies causal attention with an optional "
                                 "sliding window)")


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's kind, as transformers' caches read it (``layer_types``, else inferred from the fields)."""
    from transformers.cache_utils import get_layer_types_and_kwargs  # heavy: transformers

    text = config.get_text_config(decoder=True)
    try:
        return list(get_layer_types_and_kwargs(text)[0])
    except Exception:  # noqa: BLE001 - a config without per-layer fields: its layer_types as written, if any
        return list(getattr(text, "layer_types", None) or [])


def check_config(config: Any, arch: str) -> None:
    """Rules on the config alone (no weights, no module)."""
    text = config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch} is an encoder-decoder model; pagedllm runs decoder-only *ForCausalLM "
                                    "models only")
    if getattr(text, "add_cross_attention", False):
        raise _refuse(arch, "config.add_cross_attention: its layers attend to encoder states")
    types = layer_types(config)
    bad = sorted({t for t in types if t not in PAGED_LAYER_TYPES})
    if bad:
        where = [i for i, t in enumerate(types) if t in bad]
        what = "; ".join(f"{t}: {_LAYER_KIND.get(t, 'a cache the paged KV cache does not hold')}" for t in bad)
        raise _refuse(arch, f"config.layer_types has layers the paged cache cannot hold ({what}; layers "
                            f"{', '.join(map(str, where[:8]))}{', ...' if len(where) > 8 else ''})")
    if getattr(text, "kv_sharing_modes", None) or (getattr(text, "num_kv_shared_layers", 0) or 0) > 0:
        raise _refuse(arch, "layers share another layer's KV cache (config.kv_sharing_modes / "
                            "num_kv_shared_layers)")
    if getattr(text, "kv_lora_rank", None):
        raise _refuse(arch, "config.kv_lora_rank: multi-head latent attention (keys of qk_nope_head_dim + "
                            "qk_rope_head_dim, values of v_head_dim), which the fallback's per-head paged cache is "
                            "not sized for (the native decoder caches the latent: DeepseekV2/V3ForCausalLM)")
    for name in LOGIT_SCALES:
        if getattr(text, name, None) not in (None, 1, 1.0):
            raise _refuse(arch, f"config.{name} scales the logits after lm_head, which the fallback does not apply")


def check_modules(model: nn.Module, arch: str) -> None:
    """Rules on the built module (meta device is enough): state-keeping mixers and attention sinks."""
    for name, module in model.named_modules():
        cls = type(module).__name__
        lowered = cls.lower().replace("_", "")
        if isinstance(module, nn.Conv1d) or any(k in lowered for k in STATEFUL_MIXERS):
            kind = "a causal convolution (nn.Conv1d)" if isinstance(module, nn.Conv1d) else f"{cls}"
            raise _refuse(arch, f"module {name} is {kind}, a mixer whose state between steps is not an attention "
                                "KV cache")
    for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
        if "sink" in name.rsplit(".", 1)[-1].lower():
            raise _refuse(arch, f"{name}: attention sinks (an extra logit in every softmax), which the paged "
                                "attention does not apply")


@dataclass
class MaskSpec:
    """What HF's mask function allows a far query position ``q`` to see: ``causal`` (nothing after ``q``) and the
    ``window`` it reaches back (``None``: the whole prefix); ``other`` for any other pattern (chunks, holes)."""

    causal: bool
    window: Optional[int]
    other: str = ""

    def describe(self) -> str:
        if self.other:
            return self.other
        if not self.causal:
            return "bidirectional attention"
        return "causal attention" + (f" within a window of {self.window}" if self.window else "")


def _mask_spec(mask_function: Any) -> MaskSpec:
    q = torch.tensor(_FAR)
    kv = torch.arange(_FAR + 2)
    try:
        allowed = torch.broadcast_to(torch.as_tensor(mask_function(torch.tensor(0), torch.tensor(0), q, kv)),
                                     kv.shape).bool()
    except Exception as e:  # noqa: BLE001 - a mask that depends on more than positions (token types, padding)
        return MaskSpec(True, None, other=f"a custom mask ({type(e).__name__} reading it at one position)")
    past = allowed[:_FAR + 1]
    if bool(allowed[_FAR + 1:].any()):
        return MaskSpec(False, None)
    causal = True
    seen = torch.nonzero(past).flatten()
    if len(seen) == 0 or int(seen[-1]) != _FAR:
        return MaskSpec(causal, None, other="a mask that hides the token from itself")
    first = int(seen[0])
    if len(seen) != _FAR + 1 - first:
        return MaskSpec(causal, None, other="a mask with holes (not a window)")
    return MaskSpec(causal, None if first == 0 else _FAR + 1 - first)


def _probe_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Any = None, attention_mask: Any = None, **kwargs: Any) -> MaskSpec:
    """Stands in for HF's mask builders during the probe: the mask's meaning, read from its mask function."""
    from transformers.masking_utils import causal_mask_function  # heavy: transformers

    return _mask_spec(mask_function or causal_mask_function)


@contextlib.contextmanager
def _probe_masks(name: str) -> Iterator[None]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # heavy: transformers

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    before = mapping.get(name)
    mapping[name] = _probe_mask
    try:
        yield
    finally:
        if before is None:
            mapping.pop(name, None)
        else:
            mapping[name] = before


@dataclass
class AttentionProbe:
    """Stands in for ``PagedContext`` during the probe: records every attention call and computes it as the paged
    attention would (causal, the passed window, soft-capping), with plain torch ops."""

    calls: list[dict] = field(default_factory=list)

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: Optional[float], sliding_window: Optional[int],
                 softcap: Optional[float], kwargs: dict) -> torch.Tensor:
        extra = sorted(k for k, v in kwargs.items() if k not in HANDLED_KWARGS and v is not None)
        self.calls.append(dict(layer_idx=getattr(module, "layer_idx", None), module=type(module).__name__,
                               mask=attention_mask, window=sliding_window, extra=extra,
                               is_causal=getattr(module, "is_causal", True),
                               shapes=(tuple(query.shape), tuple(key.shape), tuple(value.shape))))
        q, k, v = query[0].float(), key[0].float(), value[0].float()  # [H, T, D]
        if v.shape[0] != k.shape[0] or q.shape[0] % k.shape[0] or k.shape[-1] != q.shape[-1]:
            return torch.zeros(1, q.shape[1], q.shape[0], v.shape[-1], dtype=query.dtype, device=query.device)
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
        scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        t = q.shape[1]
        i = torch.arange(t, device=q.device)
        keep = i[None, :] <= i[:, None]
        if sliding_window:
            keep &= i[None, :] > i[:, None] - sliding_window
        scores = scores.masked_fill(~keep, float("-inf"))
        out = torch.softmax(scores, -1) @ v  # [H, T, Dv]
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def probe(model: Any, arch: str) -> None:
    """Run a few tokens through ``model`` (a ``TransformersCausalLM`` with weights) with a recording attention; refuse
    what the paged path would run differently from HF (see the module docstring)."""
    hf, config = model.hf, model.config
    name = config._attn_implementation
    ids = torch.arange(3, 3 + _PROBE_TOKENS, device=model.device)[None] % model.vocab_size
    positions = torch.arange(_PROBE_TOKENS, device=model.device)[None]
    rec = AttentionProbe()
    try:
        with torch.inference_mode(), _probe_masks(name):
            hidden = model.decoder(input_ids=ids, position_ids=positions, use_cache=False, pagedllm=rec)[0][0]
            ours = model.compute_logits(hidden)
            layer_calls = list(rec.calls)
            rec.calls.clear()
            theirs = hf(input_ids=ids, position_ids=positions, use_cache=False, pagedllm=rec).logits[0]
    except MissingPagedContext as e:
        raise _refuse(arch, "its attention modules do not pass the forward's keyword arguments on to the attention "
                            "function, so the step's paged-cache metadata cannot reach it") from e
    except Exception as e:  # a module that cannot run this way would fail (or worse) when serving
        raise _refuse(arch, f"its module does not run as decoder + lm_head with the paged attention function "
                            f"({type(e).__name__} at start-up: {str(e)[:200]})") from e
    types = layer_types(config)
    n = model.num_layers
    by_layer: dict[Any, list[dict]] = {}
    for c in layer_calls:
        by_layer.setdefault(c["layer_idx"], []).append(c)
    stray = [k for k in by_layer if not isinstance(k, int) or not 0 <= k < n]
    if stray:
        raise _refuse(arch, f"attention runs with layer_idx {stray!r}, outside the model's {n} layers")
    twice = [i for i, c in sorted(by_layer.items()) if len(c) > 1]
    if twice:
        raise _refuse(arch, f"layers {twice} attend more than once per forward (shared or repeated attention "
                            "blocks), and each call would write the same paged KV")
    silent = [i for i in range(n) if i not in by_layer and (i >= len(types) or types[i] != "dummy")]
    if silent:
        mixers = sorted({type(m).__name__ for i in silent[:1] for m in _children(model.decoder, i)})
        raise _refuse(arch, f"layers {silent[:8]} never call attention (their mixer: {', '.join(mixers) or '?'}), "
                            "so whatever they carry between steps is not in the paged cache")
    for i, (c,) in sorted(by_layer.items()):
        (qs, ks, vs) = c["shapes"]
        if c["extra"]:
            what = "attention sinks" if any("aux" in e or "sink" in e for e in c["extra"]) else "attention inputs"
            raise _refuse(arch, f"layer {i} ({c['module']}) passes {', '.join(c['extra'])} to the attention "
                                f"function ({what} the paged attention ignores)")
        if ks != vs or ks[1] != model.num_kv_heads or ks[-1] != model.head_size or qs[1] != model.num_heads \
                or qs[-1] != model.head_size:
            raise _refuse(arch, f"layer {i}: query/key/value shapes {qs}/{ks}/{vs} are not the paged cache's "
                                f"{model.num_heads} query heads and {model.num_kv_heads} KV heads of size "
                                f"{model.head_size}")
        mask = c["mask"]
        if not c["is_causal"] or (isinstance(mask, MaskSpec) and (mask.other or not mask.causal)):
            shown = mask.describe() if isinstance(mask, MaskSpec) else "bidirectional attention (is_causal=False)"
            hint = "" if isinstance(mask, MaskSpec) and mask.causal else " (an encoder: BERT-style classes attend " \
                "causally only with config.is_decoder=True)"
            raise _refuse(arch, f"layer {i} runs {shown}, not causal attention{hint}")
        if isinstance(mask, MaskSpec) and (mask.window or None) != (c["window"] or None):
            source = "config.layer_types / config.sliding_window" if types else "config.sliding_window"
            raise _refuse(arch, f"layer {i}: HF masks it as {mask.describe()} ({source}) but its attention "
                                f"module passes sliding_window={c['window']} to the attention function")
    if not torch.allclose(ours.float(), theirs.float(), rtol=1e-3, atol=1e-3 * max(1.0, theirs.abs().max().item())):
        raise _refuse(arch, f"{type(hf).__name__}.forward transforms the logits after lm_head of the decoder's "
                            f"output (max difference {(ours.float() - theirs.float()).abs().max().item():.3g}: a "
                            "logit multiplier, scale or extra head)")


def _children(decoder: nn.Module, i: int) -> list[nn.Module]:
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None) or getattr(decoder, "blocks", None)
    if layers is None or i >= len(layers):
        return []
    return list(layers[i].children())
