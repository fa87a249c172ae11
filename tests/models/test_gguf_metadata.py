"""GGUF metadata read once: the tensor table from transformers' header reader equals gguf.GGUFReader's, the derived
config is cached per file and equals transformers' own derivation, and the tokenizer built from that config equals
AutoTokenizer's (which would derive the config again)."""

from __future__ import annotations

import os

import gguf
import numpy as np
from transformers import AutoConfig, AutoTokenizer

from gguf_utils import write_tiny_gguf
from pagedllm.models.gguf_config import load_gguf_config, load_gguf_tokenizer
from pagedllm.models.gguf_weights import read_tensors
from pagedllm.models.paths import default_model_path


def test_tensor_table_equals_gguf_reader(tmp_path):
    for qtype in ("Q4_1", "Q6_K", "F16"):
        path = write_tiny_gguf(tmp_path / qtype, qtype)
        arch, ours = read_tensors(path)
        ref = gguf.GGUFReader(path)
        assert arch == "llama" and len(ours) == len(ref.tensors)
        for a, b in zip(ours, ref.tensors):
            assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_config_cached_per_file_equals_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m", "Q8_0")
    want = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).to_dict()
    first = load_gguf_config(path)
    cached = list((tmp_path / "cache" / "gguf-config").iterdir())
    assert len(cached) == 1 and (cached[0] / "config.json").is_file()
    second = load_gguf_config(path)  # from the cache
    for got in (first, second):
        got = got.to_dict()
        assert {k: got.get(k) for k in want if not k.startswith("_")} == {k: v for k, v in want.items()
                                                                          if not k.startswith("_")}
    os.utime(path, ns=(1, 1))  # a changed file is a new cache entry, not a stale hit
    load_gguf_config(path)
    assert len(list((tmp_path / "cache" / "gguf-config").iterdir())) == 2


def test_tokenizer_from_config_equals_autotokenizer():
    path = default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    ours = load_gguf_tokenizer(path, AutoConfig.from_pretrained(d, gguf_file=f))
    ref = AutoTokenizer.from_pretrained(d, gguf_file=f)
    text = "Hello world! <|im_start|>user\nünïcode 123 \t tabs"
    assert ours(text).input_ids == ref(text).input_ids and len(ours) == len(ref)
    assert (ours.chat_template, ours.eos_token, ours.bos_token, ours.all_special_tokens) == \
        (ref.chat_template, ref.eos_token, ref.bos_token, ref.all_special_tokens)
