"""A tiny random Llama with a word-level tokenizer: grammars whose strings its vocabulary cannot spell.

A word-level vocabulary has no byte or character tokens, so a choice such as ``"maybe"`` (not a word of it) can
never be produced: xgrammar's mask then allows no token at all, the case where an engine must end the request with
an error rather than emit a token outside the grammar. llguidance cannot read this tokenizer's (absent) decoder,
which exercises the ``auto`` backend's fallback failing.
"""

from __future__ import annotations

import os
from pathlib import Path

WORDS = ["<unk>", "<s>", "</s>", "yes", "no", "red", "green", "blue", "one", "two", "three", "{", "}", ":", ","]


def word_level_model(out_dir: str | os.PathLike) -> str:
    """Build (once) and return the model folder."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import save_random_model

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    save_random_model(dict(model_type="llama", vocab_size=len(WORDS), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           tie_word_embeddings=True), out)
    fast.save_pretrained(out)
    return str(out)
