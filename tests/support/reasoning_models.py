"""A scripted reasoning model for end-to-end tests: its greedy output is a fixed script, tags included.

The model is a one-layer Llama whose attention and MLP write nothing (``o_proj`` and ``down_proj`` are zero), so
the logits depend on the last token only: token ``t`` embeds to a one-hot direction and the LM head maps that
direction to ``SUCC[t]``. Greedy decoding then follows a chain of tokens from the prompt's last token, which the chat
template picks. SmolLM2's tokenizer gets ``<think>``/``</think>`` (added, not special, as in Qwen3) and harmony's
markers (special, as in GPT-OSS). A chain never revisits a token, so the second harmony header spells its markers
with two added halves each (``<|chan`` + ``nel|>``): the same text, other token ids.

Scripts (prompt end -> output):
- ``\\n`` (after ``<|im_start|>assistant``): ``<think>I should greet</think>Hello there``
- ``<think>`` (``think_in_prompt=True``: DeepSeek-R1's template opens the tag): ``I should greet</think>Hello there``
- ``</think>\\n\\n`` (``enable_thinking=False``): ``Plain reply``
- ``<|start|>assistant`` (``HARMONY_TEMPLATE``): ``<|channel|>analysis<|message|>Weigh options<|end|><|start|>
  assistant<|channel|>final<|message|>Sure thing<|return|>``
"""

from __future__ import annotations

import os
from pathlib import Path

THINK_TOKENS = ["<think>", "</think>"]
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
SPLIT_MARKERS = ["<|chan", "nel|>", "<|mess", "age|>"]  # second spellings of <|channel|> and <|message|>

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort is defined and reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt is defined and think_in_prompt %}<think>{% endif %}{% endif %}")
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if reasoning_effort is defined and reasoning_effort %}<|start|>system<|message|>Reasoning: "
    "{{ reasoning_effort }}<|end|>{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")

REASONING = "I should greet"
ANSWER = "Hello there"
PLAIN = "Plain reply"
HARMONY_REASONING = "Weigh options"
HARMONY_ANSWER = "Sure thing"


def scripts(tok) -> list[list[int]]:
    """The chains as token ids, each from the prompt's last token to EOS."""
    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def one(token: str) -> int:
        return tok.convert_tokens_to_ids(token)

    think, end_think = one("<think>"), one("</think>")
    eos = tok.eos_token_id
    harmony = ([one("<|channel|>")] + ids("analysis") + [one("<|message|>")] + ids(HARMONY_REASONING)
               + [one("<|end|>"), one("<|start|>")] + ids(" assistant") + [one("<|chan"), one("nel|>")]
               + ids("final") + [one("<|mess"), one("age|>")] + ids(HARMONY_ANSWER) + [one("<|return|>"), eos])
    return [
        ids("\n")[-1:] + [think] + ids(REASONING) + [end_think] + ids(ANSWER) + [eos],
        ids("\n\n")[-1:] + ids(PLAIN) + [eos],
        ids("<|start|>assistant")[-1:] + harmony,
    ]


def reasoning_tokenizer():
    """SmolLM2's tokenizer with the think tags, harmony's markers and their split spellings added."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from server_utils import tiny_chat_model

    tok = AutoTokenizer.from_pretrained(tiny_chat_model())
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS + SPLIT_MARKERS])
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def scripted_reasoning_model(out_dir: str | os.PathLike) -> str:
    """Build (once) the scripted model with its tokenizer and ``CHAT_TEMPLATE`` in ``out_dir``; returns the path."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = reasoning_tokenizer()
    succ: dict[int, int] = {}
    for chain in scripts(tok):
        for a, b in zip(chain, chain[1:]):
            assert succ.setdefault(a, b) == b, f"token {tok.convert_ids_to_tokens(a)!r} has two successors"
    states = sorted(succ)
    hidden = 64
    assert len(states) <= hidden, len(states)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=512,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for k, t in enumerate(states):
            emb[t, k] = 1.0
            head[succ[t], k] = 1.0
        # q, k, v are zeros too: attention averages zero values, so only the last token matters.
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
