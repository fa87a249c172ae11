"""Tiny random BERT / XLM-RoBERTa checkpoints (config + safetensors, float32, seeded), with a WordPiece tokenizer and,
on request, a sentence-transformers folder layout (``modules.json``, ``1_Pooling``): exact oracles, no downloads.

LayerNorm weights and biases are randomized too (HF inits them to ones / zeros) so a wrong mapping of any tensor
shows in the outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

#: Words of the tokenizer's vocabulary after the special tokens; WordPiece lower-cases and splits on spaces.
WORDS = ("the cat dog sat on a mat red blue green fast slow run jump over under big small house tree river "
         "what is where who how why many few one two three paris france city capital of in and or not").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    # token types 2 (pairs), 4 heads of 16, exact GELU
    "bert": dict(model_type="bert", vocab_size=len(SPECIALS) + len(WORDS) + 3, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2,
                 hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0, initializer_range=0.2),
    # RoBERTa: XLM-R's layers and positions under its own model_type (and a bigger vocabulary, 3 heads of 16)
    "roberta": dict(model_type="roberta", vocab_size=150, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=3, max_position_embeddings=40, type_vocab_size=1, hidden_act="gelu",
                    layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2, initializer_range=0.2),
    # positions offset past pad_token_id 1 (66 rows hold 64 tokens), one token type, 2 heads of 24
    "xlm-roberta": dict(model_type="xlm-roberta", vocab_size=120, hidden_size=48, intermediate_size=80,
                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=66, type_vocab_size=1,
                        hidden_act="gelu", layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        initializer_range=0.2),
}


def _randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "layernorm" in name.lower():
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def write_wordpiece_tokenizer(out: Path, max_len: int) -> None:
    """A ``BertTokenizerFast`` over :data:`WORDS` (``vocab.txt`` + ``tokenizer.json``)."""
    from transformers import BertTokenizerFast

    (out / "vocab.txt").write_text("\n".join(SPECIALS + WORDS) + "\n")
    tok = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True, model_max_length=max_len)
    tok.save_pretrained(out)


def make_tiny_encoder(kind: str, out_dir: str | os.PathLike, *, classification: bool = False, num_labels: int = 3,
                      seed: int = 0, pooling: Optional[str] = None, normalize: bool = False,
                      **overrides: Any) -> str:
    """A tiny random ``kind`` ("bert", "roberta" or "xlm-roberta") saved in ``out_dir``: the base model, or
    ``*ForSequenceClassification`` with ``num_labels``. BERT gets a WordPiece tokenizer. ``pooling`` ("cls" /
    "mean" / "lasttoken") also writes the sentence-transformers layout (Transformer, Pooling and, with
    ``normalize``, Normalize modules) around the same weights."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    kwargs = {**ENCODER_CONFIGS[kind], **overrides}
    if classification:
        kwargs["num_labels"] = num_labels
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    cls = AutoModelForSequenceClassification if classification else AutoModel
    model = cls.from_config(config, dtype=torch.float32).eval()
    _randomize_norms_and_biases(model, seed + 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if kind == "bert":
        write_wordpiece_tokenizer(out, config.max_position_embeddings)
    if pooling is not None:
        write_sentence_transformers_layout(out, config.hidden_size, pooling, normalize)
    return str(out)


def write_sentence_transformers_layout(out: Path, hidden: int, pooling: str, normalize: bool) -> None:
    """``modules.json`` (Transformer at the root, ``1_Pooling``, optionally ``2_Normalize``), as sentence-transformers
    saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    cfg = {"word_embedding_dimension": hidden, **{m: False for m in modes.values()}, modes[pooling]: True,
           "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
           "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
