"""EAGLE draft head (Li et al. 2024; vLLM's ``EagleLlamaForCausalLM``): a small decoder that drafts from the
target's own features instead of from tokens alone.

Head input at position ``p``: ``fc(cat(embed(token[p + 1]), h[p]))`` where ``h[p]`` is the target's final-normed
hidden state at ``p`` (the feature its lm_head read to predict ``token[p + 1]``). Then Llama decoder layer(s), the
first without ``input_layernorm``; the output (residual added, no final norm) goes through the TARGET's lm_head and
is fed back as ``h`` for the next draft step. ``embed_tokens`` is the target's (as in vLLM); ``lm_head`` too unless
the checkpoint has its own.

Checkpoint (the EAGLE repo's and vLLM's layout): a folder with ``config.json`` (a Llama config; architectures
``EagleLlamaForCausalLM``, ``LlamaForCausalLMEagle`` or ``LlamaForCausalLM``) and ``*.safetensors`` or
``pytorch_model.bin`` holding ``fc.weight`` [hidden, 2 * hidden] (``fc.bias`` optional), ``layers.{i}.*`` HF Llama
names, optionally ``embed_tokens.weight`` (ignored: the target's is used) and ``lm_head.weight``; names may carry a
``model.`` prefix.

The proposer keeps, per request, the target hidden states the head has not consumed yet (``Request.eagle_hidden``,
recorded after each verified step) and runs the head over its own paged KV cache at the target's block ids, like
the draft-model proposer: one catch-up chunk (every position the target verified since the last proposal), then
``k - 1`` single-token steps on the head's own hidden states.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.sample.greedy import greedy_token_ids
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request
from pagedllm.errors import ParamError
from pagedllm.spec_decode.draft_model import draft_batch
from pagedllm.spec_decode.manager import eligible
from pagedllm.models import load_config, resolve_model_path
from pagedllm.models.arch import ARCHITECTURES
from pagedllm.models.causal_lm import DecoderLayer
from pagedllm.models.rope import build_cos_sin_cache
from pagedllm.models.weights import SafetensorsWeights, fused_state_dict

logger = logging.getLogger(__name__)

EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM")
FLUSH_PENDING = 128  # a request not speculating runs the head over its features once this many are pending
MAX_PENDING = 1024  # hard cap on kept features per request (older ones are dropped: the head's K/V there is stale)


class EagleHead(nn.Module):
    """The head's weights and forward; ``embed`` and (shared) ``logits`` come from the target."""

    def __init__(self, config: Any, backend: Any, target: Any, fc_bias: bool, own_lm_head: bool):
        super().__init__()
        spec = ARCHITECTURES["LlamaForCausalLM"]
        self.config = config
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_size: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size: int = config.vocab_size
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, backend, None, i) for i in range(self.num_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE: the fused input is not normed before attention
        if own_lm_head:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.target = [target]  # a list: not a submodule (its weights are not the head's)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.kv_caches: list = []
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``[T]`` tokens, positions and ``[T, hidden]`` features -> ``[T, hidden]`` (fed back as features)."""
        emb = self.target[0].embed_tokens(input_ids)
        h = self.fc(torch.cat((emb, hidden.to(emb.dtype)), dim=-1))
        for layer, kv_cache in zip(self.layers, self.kv_caches, strict=True):
            h = layer(h, positions, kv_cache, meta, self.cos_sin_cache)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return F.linear(hidden, self.lm_head.weight)
        return self.target[0].compute_logits(hidden)


class _Renamed:
    """Checkpoint tensors under our names: a ``model.`` prefix dropped, ``embed_tokens`` ignored."""

    def __init__(self, tensors: dict[str, Any], take: Any):
        self._names = {n.removeprefix("model."): n for n in tensors if "embed_tokens" not in n}
        self._take = take

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def take(self, name: str) -> torch.Tensor:
        return self._take(self._names.pop(name))

    def left(self) -> list[str]:
        return sorted(self._names)


def _open(path: str) -> _Renamed:
    if glob.glob(os.path.join(path, "*.safetensors")):
        st = SafetensorsWeights(path)
        return _Renamed(dict.fromkeys(st.names()), st.take)
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise ParamError("speculative_config.model", f"{path} holds no *.safetensors or pytorch_model.bin weights")
    tensors: dict[str, torch.Tensor] = {}
    for b in bins:
        tensors.update(torch.load(b, map_location="cpu", weights_only=True))
    return _Renamed(tensors, tensors.pop)


def load_eagle_head(path: str, target: Any, backend: Any, dtype: torch.dtype, device: torch.device,
                    max_model_len: int) -> EagleHead:
    """Build the EAGLE head in ``path`` for ``target`` (a native decoder); errors name ``speculative_config.model``."""
    field = "speculative_config.model"
    try:
        path = resolve_model_path(path)
        config = load_config(path)
    except Exception as e:
        raise ParamError(field, f"cannot load EAGLE head {path!r}: {e}") from e
    archs = list(getattr(config, "architectures", None) or [])
    if getattr(config, "model_type", None) != "llama" or (archs and not set(archs) & set(EAGLE_ARCHITECTURES)):
        raise ParamError(field, f"EAGLE heads of Llama layout are supported ({', '.join(EAGLE_ARCHITECTURES)}); "
                                f"got model_type {getattr(config, 'model_type', None)!r}, architectures {archs}")
    if getattr(config, "add_para_norm", False):
        raise ParamError(field, "HASS heads (add_para_norm) are not supported")
    if not hasattr(target, "embed_tokens") or not hasattr(target, "lm_head_weight"):
        raise ParamError(field, f"EAGLE needs a native decoder as target, not {type(target).__name__}")
    for name in ("hidden_size", "vocab_size"):
        if getattr(config, name) != getattr(target, name):
            raise ParamError(field, f"EAGLE head {name} {getattr(config, name)} differs from the target's "
                                    f"{getattr(target, name)}")
    weights = _open(path)
    if "fc.weight" not in weights:
        raise ParamError(field, f"{path} is not an EAGLE head: no fc.weight tensor")
    with torch.device("meta"):
        head = EagleHead(config, backend, target, "fc.bias" in weights, "lm_head.weight" in weights)
    try:
        head.load_state_dict(fused_state_dict(head, weights, dtype, device), strict=True, assign=True)
    except KeyError as e:
        raise ParamError(field, f"EAGLE head checkpoint: {e.args[0]}") from None
    if weights.left():
        logger.warning("EAGLE head %s: tensors not used: %s", path, ", ".join(weights.left()))
    head.cos_sin_cache = build_cos_sin_cache(config, config.max_position_embeddings, device, max_model_len)
    return head.eval()


def recordable(req: Request) -> bool:
    """Requests that may ever speculate (``manager.eligible`` without the min_tokens wait) keep target features."""
    return eligible(req, ignore_min_tokens=True)


class EagleProposer:
    def __init__(self, head: EagleHead, kv: KVCacheManager, device: torch.device):
        self.model, self.kv, self.device = head, kv, device

    @torch.inference_mode()
    def record(self, hidden: torch.Tensor, spans: Sequence[tuple[Request, int, int, int]]) -> None:
        """Keep the target's features of the verified positions: ``(request, first position, first row, rows)``."""
        for r, pos, row, n in spans:
            if n <= 0 or r.is_finished or not recordable(r):
                continue
            rows = hidden[row:row + n].clone()
            if r.eagle_hidden is None or pos != r.eagle_hidden_start + r.eagle_hidden.shape[0]:
                r.eagle_hidden, r.eagle_hidden_start = rows, pos  # a new run (prefill, recompute, or a gap)
            else:
                r.eagle_hidden = torch.cat((r.eagle_hidden, rows))
            extra = r.eagle_hidden.shape[0] - MAX_PENDING
            if extra > 0:
                r.eagle_hidden, r.eagle_hidden_start = r.eagle_hidden[extra:], r.eagle_hidden_start + extra

    def flush(self, reqs: Sequence[Request]) -> None:
        """Consume long pending features of requests that do not speculate this step (throttled ones), so their
        memory stays bounded and the head's K/V stays exact for when they speculate again."""
        long = [r for r in reqs if r.eagle_hidden is not None and r.eagle_hidden.shape[0] >= FLUSH_PENDING]
        if long:
            self.propose(long, [1] * len(long))

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` argmax drafts per decoding request; none for one without the target's latest features."""
        bs = self.kv.block_size
        out: list[list[int]] = [[] for _ in reqs]
        chunks: list[list[int]] = [[] for _ in reqs]
        feats: list[Optional[torch.Tensor]] = [None] * len(reqs)
        starts = [0] * len(reqs)
        active = []
        for i, r in enumerate(reqs):
            n, h = r.num_tokens, r.eagle_hidden
            if ks[i] <= 0 or h is None or r.eagle_hidden_start + h.shape[0] != n - 1:
                continue  # the target's feature at n - 2 is missing (just resumed): no drafts this step
            # Catch up from the first position the head has not computed with real features (a gap, e.g. prefix
            # cache hits, starts where the features do: those blocks hold the head's K/V from their first owner).
            s0 = max(r.draft_num_computed, r.eagle_hidden_start)
            chunks[i] = r.all_token_ids[s0 + 1:n]
            feats[i] = h[s0 - r.eagle_hidden_start:]
            starts[i] = s0
            active.append(i)
        tables = {i: self.kv.block_ids(reqs[i].request_id) for i in active}
        for j in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > j]
            if not active:
                break
            order, ids, pos, meta = draft_batch(active, chunks, starts, tables, bs, self.device)
            hidden = self.model(ids, pos, torch.cat([feats[i] for i in order]).to(self.device), meta)
            last = torch.tensor(meta.query_start_loc_cpu[1:], dtype=torch.long, device=hidden.device) - 1
            h_last = hidden.index_select(0, last)
            toks = greedy_token_ids(self.model.compute_logits(h_last)).tolist()
            for row, (i, t) in enumerate(zip(order, toks)):
                out[i].append(t)
                starts[i] += len(chunks[i])
                chunks[i], feats[i] = [t], h_last[row:row + 1]
        for r, o in zip(reqs, out):
            if o:  # real features consumed up to n - 2; the draft positions are recomputed once verified
                r.draft_num_computed = r.num_tokens - 1
                r.eagle_hidden, r.eagle_hidden_start = None, r.num_tokens - 1
        return out
