"""Encoder-only models: BERT and (XLM-)RoBERTa, for embeddings and cross-encoder classification (vLLM's
``BertEmbeddingModel`` / ``BertForSequenceClassification``, ``XLMRobertaModel`` /
``XLMRobertaForSequenceClassification``).

Post-LN encoder layers (attention + residual + LayerNorm, then the MLP + residual + LayerNorm), absolute learned
positions plus token-type embeddings, ``hidden_act`` from transformers (exact GELU for BERT). Attention is
bidirectional inside each sequence and goes through the backend's ``encoder_attention`` hook (varlen, unpaged): these
models hold no KV cache and never call ``write_kv`` / ``paged_attention``. q/k/v are fused into one matmul
(``qkv_proj``, read from HF's ``query`` / ``key`` / ``value``); every other parameter keeps its HF name, so a
checkpoint of the base model (sentence-transformers' ``0_Transformer``), of a head model (``bert.`` / ``roberta.``
prefixed) or one saved under ``model.`` loads by name (``build_encoder_model``).

What the pooling runner (``pagedllm.pooling``) reads from these models:

- ``requires_kv_cache = False``: no KV blocks; each sequence of a step is a *whole* prompt (never a chunk), so a prompt
  over the step's token budget is refused rather than chunked.
- ``forward(input_ids, positions, meta) -> hidden [T, H]``: the last hidden state of the flat batch, sequence i being
  rows ``meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i+1]`` (rows past the last sequence are padding; their
  output is unspecified). ``positions`` are the positions within each prompt (0, 1, ...); RoBERTa shifts them past
  ``pad_token_id`` as HF does. ``meta.extra.get("token_type_ids")`` (int ``[T]``, a tensor or a list; the segment
  of each token, 0/1 for a tokenizer-encoded pair) feeds the token-type embedding; absent: all zeros.
- ``default_pooling_type = "CLS"``: embeddings pool the first row of each sequence unless the checkpoint's
  sentence-transformers config (``1_Pooling``) or ``--pooler-config`` says otherwise; classification always reads
  the CLS row (what HF's heads read).
- ``num_labels``: the classifier's width, ``None`` for the base model (no head).
- ``score(cls_rows [N, H]) -> logits [N, num_labels]`` (alias ``classify``; ``None`` on the base model): the
  classification head applied to CLS rows of the last hidden state. BERT: the pooler (dense + tanh), then
  ``classifier``; RoBERTa: HF's ``RobertaClassificationHead`` (dense + tanh + ``out_proj``). Dropout is off, as in
  HF's ``eval()``.
- ``has_lm_head = False``, ``supports_lora = False``, ``kv_caches = []``; ``max_model_len`` is the longest prompt
  the position table holds (``encoder_max_positions``: XLM-R's 514 rows hold 512 tokens).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError

#: Architectures served by this module: name -> (RoBERTa-style positions, classification head).
ENCODER_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "BertModel": (False, False), "BertForSequenceClassification": (False, True),
    "RobertaModel": (True, False), "RobertaForSequenceClassification": (True, True),
    "XLMRobertaModel": (True, False), "XLMRobertaForSequenceClassification": (True, True),
}


def _activation(name: str):
    from transformers.activations import ACT2FN  # heavy: transformers

    return ACT2FN[name]


def _roberta_style(config: Any) -> bool:
    return getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert")


def encoder_max_positions(config: Any) -> int:
    """The longest prompt the position table holds: RoBERTa's positions start at ``pad_token_id + 1``."""
    n = config.max_position_embeddings
    return n - (config.pad_token_id + 1) if _roberta_style(config) else n


def check_encoder(config: Any) -> None:
    """Refuse, naming the field, what HF would run differently from this module."""
    name = (getattr(config, "architectures", None) or [config.model_type])[0]
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(f"{name}: is_decoder / add_cross_attention configs (causal or cross-attention "
                                    "BERT) are not encoders; pagedllm runs the bidirectional encoder only")
    kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise UnsupportedModelError(f"{name}: position_embedding_type {kind!r} is not supported (absolute only)")
    if config.hidden_size % config.num_attention_heads:
        raise UnsupportedModelError(f"{name}: hidden_size {config.hidden_size} is not a multiple of "
                                    f"num_attention_heads {config.num_attention_heads}")


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.num_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.scale = self.head_size ** -0.5
        self.encoder_attention = backend.encoder_attention

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_size).unbind(1)
        out = self.encoder_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, False)
        return out.reshape(t, self.num_heads * self.head_size)


class BertSelfOutput(nn.Module):
    """Dense, then LayerNorm of the residual sum (HF's ``BertSelfOutput`` and ``BertOutput`` alike)."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.self = BertSelfAttention(config, backend)  # HF's name: attention.self.*
        self.output = BertSelfOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        return self.output(self.self(x, cu_seqlens, max_seqlen), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.attention = BertAttention(config, backend)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = self.attention(x, cu_seqlens, max_seqlen)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, backend) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, cu_seqlens, max_seqlen)
        return x


class BertPooler(nn.Module):
    """BERT's pooler: dense + tanh over the CLS row (read by its classification head only)."""

    def __init__(self, config: Any):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_rows))


class RobertaClassificationHead(nn.Module):
    """HF's ``RobertaClassificationHead`` (XLM-R's too): dense + tanh + ``out_proj`` on the CLS row."""

    def __init__(self, config: Any, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, num_labels)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_rows)))


def num_labels_of(config: Any) -> int:
    return int(getattr(config, "num_labels", 0) or len(getattr(config, "id2label", None) or {}) or 2)


class BertModel(nn.Module):
    """A BERT-family encoder behind pagedllm's model interface; see the module docstring for what the pooling runner
    reads. ``classification`` adds the architecture's sequence-classification head; ``roberta`` the RoBERTa
    position offset and head."""

    requires_kv_cache = False
    default_pooling_type = "CLS"
    has_lm_head = False
    supports_lora = False
    kv_cache_mla = False

    def __init__(self, config: Any, backend: Any, *, roberta: bool = False, classification: bool = False):
        super().__init__()
        check_encoder(config)
        self.config = config
        self.roberta = roberta
        self.pad_token_id = int(config.pad_token_id or 0) if roberta else 0
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_attention_heads
        self.head_size: int = config.hidden_size // config.num_attention_heads
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = encoder_max_positions(config)
        self.layer_sliding_windows: list[Optional[int]] = [None] * self.num_layers
        self.sliding_window: Optional[int] = None
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config, backend)
        self.num_labels: Optional[int] = num_labels_of(config) if classification else None
        self.pooler: Optional[nn.Module] = None
        self.classifier: Optional[nn.Module] = None
        if classification and roberta:
            self.classifier = RobertaClassificationHead(config, self.num_labels)
        elif classification:
            self.pooler = BertPooler(config)
            self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        # the head as the pooling runner calls it; None without one (``classifier_of`` then finds none)
        self.score: Optional[Callable[[torch.Tensor], torch.Tensor]] = self._score if classification else None
        self.classify = self.score
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    def _token_types(self, meta: AttentionMetadata, t: int, device: torch.device) -> torch.Tensor:
        given = meta.extra.get("token_type_ids") if meta.extra else None
        out = torch.zeros(t, dtype=torch.long, device=device)
        if given is not None:
            given = torch.as_tensor(given, dtype=torch.long).to(device)
            out[:given.shape[0]] = given[:t]
        return out

    def _positions(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """BERT: the positions as given. RoBERTa: HF's ``create_position_ids_from_input_ids`` per sequence — the
        running count of non-pad tokens plus ``pad_token_id`` (pad tokens themselves get ``pad_token_id``)."""
        if not self.roberta:
            return positions
        qsl = meta.query_start_loc_cpu
        n, pad = qsl[-1], self.pad_token_id
        mask = input_ids[:n].ne(pad).long()
        counts = mask.cumsum(0)
        before = torch.cat((counts.new_zeros(1), counts))[torch.tensor(qsl[:-1], device=counts.device)]
        lens = torch.tensor([b - a for a, b in zip(qsl[:-1], qsl[1:])], device=counts.device)
        out = torch.full_like(positions, pad, dtype=torch.long)
        out[:n] = (counts - torch.repeat_interleave(before, lens, output_size=n)) * mask + pad
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The last hidden state ``[T, H]`` of whole prompts (see the module docstring)."""
        t = input_ids.shape[0]
        h = self.embeddings(input_ids, self._positions(input_ids, positions, meta),
                            self._token_types(meta, t, input_ids.device))
        return self.encoder(h, meta.query_start_loc, meta.max_query_len)

    def _score(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """Classification logits ``[N, num_labels]`` of CLS rows ``[N, H]`` of the last hidden state."""
        if self.pooler is not None:
            cls_rows = self.pooler(cls_rows)
        return self.classifier(cls_rows)


def checkpoint_base_prefix(names: set[str]) -> str:
    """Where the encoder sits in a checkpoint: at the top (a base-model save), or under ``bert.`` / ``roberta.`` /
    ``model.`` (a head model)."""
    for prefix in ("", "bert.", "roberta.", "model."):
        if f"{prefix}embeddings.word_embeddings.weight" in names:
            return prefix
    raise UnsupportedModelError("checkpoint has no embeddings.word_embeddings.weight (nor under bert., roberta., "
                                "model.): not a BERT-family encoder")


def encoder_state_dict(model: BertModel, weights: Any, dtype: torch.dtype,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """Our parameters from HF-named tensors (``weights``: ``SafetensorsWeights``-like, with ``names()``): q/k/v
    concatenated into ``qkv_proj``, the heads (``classifier.*``) at the top, everything else under the encoder's
    prefix (LayerNorm ``gamma`` / ``beta`` read as ``weight`` / ``bias``). A missing tensor is named; tensors we do not
    use (a base model's pooler, ``position_ids``) are ignored."""
    prefix = checkpoint_base_prefix(weights.names())

    def load(name: str) -> torch.Tensor:
        if name not in weights and ".LayerNorm." in name:  # TF-era checkpoints: LayerNorm.gamma / .beta (HF renames)
            name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        if name not in weights:
            raise UnsupportedModelError(f"checkpoint lacks tensor {name!r}")
        return weights.take(name).to(device=device, dtype=dtype)

    sd = {}
    for key in model.state_dict():
        if ".qkv_proj." in key:
            base, leaf = key.split(".qkv_proj.")
            sd[key] = torch.cat([load(f"{prefix}{base}.{p}.{leaf}") for p in ("query", "key", "value")])
        elif key.startswith("classifier."):
            sd[key] = load(key)
        else:
            sd[key] = load(prefix + key)
    return sd


def build_encoder_model(path: str, config: Any, architecture: str, backend: Any, dtype: torch.dtype,
                        device: torch.device) -> BertModel:
    """Build ``architecture`` (one of :data:`ENCODER_ARCHITECTURES`) and load its safetensors weights."""
    from pagedllm.models.weights import SafetensorsWeights

    roberta, classification = ENCODER_ARCHITECTURES[architecture]
    with torch.device("meta"):
        model = BertModel(config, backend, roberta=roberta, classification=classification)
    sd = encoder_state_dict(model, SafetensorsWeights(path), dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.requires_grad_(False).eval()
