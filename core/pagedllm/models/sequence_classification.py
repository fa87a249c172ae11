"""Pooling heads on the native decoder: HF's ``*ForSequenceClassification`` ``score`` (a bias-free linear from the
hidden size to ``num_labels``), and vLLM's causal-LM-to-classifier conversion (``classifier_from_token``: the LM
head's rows of those tokens; ``is_original_qwen3_reranker``: the "yes" row minus the "no" row, one label whose sigmoid
is softmax([no, yes])[yes], the Qwen3-Reranker score).

Embedding checkpoints (``*Model``, sentence-transformers folders) have no LM head: the model then keeps none of its
own (``has_lm_head`` False; the generate runner refuses it). ``can_generate``: whether a pooling engine over the
model may also sample (not for a classifier)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.errors import UnsupportedModelError


def classifier_tokens(config: Any) -> list[str]:
    return list(getattr(config, "classifier_from_token", None) or [])


def prepare_heads(model: nn.Module, config: Any, architecture: str, weights: Any) -> None:
    """Before the weights load (meta device): add ``score`` for a ``*ForSequenceClassification`` checkpoint, and
    drop the LM head a checkpoint does not have."""
    model.has_lm_head = True
    model.num_labels = None
    if architecture.endswith("ForSequenceClassification") and not classifier_tokens(config):
        n = int(getattr(config, "num_labels", 0) or len(getattr(config, "id2label", {}) or {}) or 2)
        model.score = nn.Linear(config.hidden_size, n, bias=False)
        model.num_labels = n
    if not getattr(model, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
        # No LM head in the checkpoint (an embedding or classification model): nothing to load, no logits.
        del model.lm_head
        model.tie_word_embeddings = True  # lm_head_weight then names the embedding (never used for logits)
        model.has_lm_head = False
    # A classifier (its own head, or a causal LM converted by classifier_from_token) never samples, even where a tied
    # embedding could serve as an LM head; a causal LM pooled by --convert embed keeps generating (docs/pooling.md).
    model.can_generate = model.has_lm_head and not architecture.endswith("ForSequenceClassification")


def finish_heads(model: nn.Module, config: Any, tokenizer: Any) -> None:
    """After loading: build ``score`` from the LM head's rows for ``classifier_from_token`` (needs the tokenizer)."""
    tokens = classifier_tokens(config)
    if not tokens:
        return
    if not model.has_lm_head and not getattr(config, "tie_word_embeddings", False):
        raise UnsupportedModelError("classifier_from_token needs the causal LM's head, and this checkpoint has none")
    if tokenizer is None:
        raise UnsupportedModelError("classifier_from_token needs the model's tokenizer to find "
                                    f"{tokens}; the folder has none")
    ids = []
    for t in tokens:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or i == tokenizer.unk_token_id:
            raise UnsupportedModelError(f"classifier_from_token: {t!r} is not one token of the model's vocabulary")
        ids.append(int(i))
    head = model.lm_head_weight
    rows = head.index_select(0, torch.tensor(ids, device=head.device))
    if getattr(config, "is_original_qwen3_reranker", False):
        if len(ids) != 2:
            raise UnsupportedModelError("is_original_qwen3_reranker needs classifier_from_token of two tokens "
                                        f"(no, yes), got {tokens}")
        rows = (rows[1] - rows[0]).unsqueeze(0)  # sigmoid(yes - no) = softmax([no, yes])[yes]
    score = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    score.weight = nn.Parameter(rows.clone(), requires_grad=False)
    model.score = score
    model.num_labels = rows.shape[0]
