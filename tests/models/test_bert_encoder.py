"""BERT, RoBERTa and XLM-RoBERTa (models/bert.py) against HF transformers on tiny random checkpoints: the last hidden
state, the CLS row and the sequence-classification logits, one prompt at a time, as one flat varlen batch and as a
padded static-shape step; token types; RoBERTa's padding-aware positions; no KV cache touched; configs HF would run
differently are refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import get_backend
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import architecture_of
from pagedllm.models.bert import BertModel
from pagedllm.models.loader import load_config, load_model
from tiny_encoders import make_tiny_encoder

ATOL = RTOL = 1e-4
PROMPTS = {"bert": [[2, 10, 11, 12, 3], [2, 7, 3], list(range(5, 45)), [2, 30, 31, 32, 33, 34, 35, 3], [2]],
           "xlm-roberta": [[0, 10, 11, 12, 2], [0, 7, 2], list(range(3, 60)), [0, 30, 31, 1, 33, 2], [0]],
           "roberta": [[0, 100, 2], list(range(3, 40)), [0, 5, 6, 7, 2]]}


@pytest.fixture(scope="module", params=[("bert", False), ("bert", True), ("xlm-roberta", False),
                                        ("xlm-roberta", True), ("roberta", True)],
                ids=lambda p: p[0] + ("-cls" if p[1] else ""))
def checkpoint(request, tmp_path_factory):
    kind, classification = request.param
    path = make_tiny_encoder(kind, tmp_path_factory.mktemp(kind), classification=classification, num_labels=3)
    return kind, classification, path


def hf_model(path: str, classification: bool):
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if classification else AutoModel
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def flat_meta(lens: list[int], **extra) -> AttentionMetadata:
    """A step of whole prompts with no KV slots (what the pooling runner gives an encoder)."""
    meta = AttentionMetadata.build(lens, lens, [[] for _ in lens], 16, slot_mapping=[-1] * sum(lens))
    meta.extra.update(extra)
    return meta


def run(model, prompts: list[list[int]], token_types=None) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    extra = {} if token_types is None else {"token_type_ids": torch.tensor([t for p in token_types for t in p])}
    with torch.inference_mode():
        return model(ids, positions, flat_meta([len(p) for p in prompts], **extra))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", ["cpu"])
def test_matches_hf_one_by_one_and_batched(checkpoint, device):
    kind, classification, path = checkpoint
    model = load_model(path, backend=get_backend(device), dtype=torch.float32, device=torch.device(device))
    assert isinstance(model, BertModel) and model.requires_kv_cache is False and model.kv_caches == []
    hf = hf_model(path, classification)
    prompts = PROMPTS[kind]
    batched = run(model, prompts)
    start = 0
    for p in prompts:
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([p]), output_hidden_states=True)
        want = out.hidden_states[-1][0]
        close(run(model, [p]), want)  # alone
        close(batched[start:start + len(p)], want)  # in a flat varlen batch with the others
        if classification:
            assert model.num_labels == 3
            close(model.score(batched[start:start + 1]), out.logits)  # the head on the CLS row
        else:
            assert model.num_labels is None and model.score is None
            close(batched[start], out.last_hidden_state[0, 0])  # CLS pooling's row
        start += len(p)


def test_reference_backend_gives_the_same_hidden_states(checkpoint, ref_backend):
    """The encoder through core's reference encoder_attention (what a backend without the hook runs) equals the CPU
    backend's fused SDPA."""
    kind, classification, path = checkpoint
    cpu = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    ref = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert not ref_backend.implements("pagedllm_encoder_attention")
    close(run(ref, PROMPTS[kind]), run(cpu, PROMPTS[kind]))


def test_bert_token_type_ids_match_hf_pairs(tmp_path):
    """A tokenizer-encoded pair (segment 0, then 1) through ``meta.extra["token_type_ids"]``, next to a single
    sentence with no token types given (zeros)."""
    from transformers import AutoTokenizer

    path = make_tiny_encoder("bert", tmp_path / "bert", classification=True, num_labels=1)
    tok = AutoTokenizer.from_pretrained(path)
    pair = tok("what is the capital of france", "paris is the capital of france")
    single = tok("the cat sat on a mat")
    assert set(pair["token_type_ids"]) == {0, 1}
    model = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    hf = hf_model(path, True)
    prompts = [pair["input_ids"], single["input_ids"]]
    hidden = run(model, prompts, token_types=[pair["token_type_ids"], [0] * len(single["input_ids"])])
    no_types = run(model, prompts)  # absent: zeros, so the pair's second segment differs
    with torch.no_grad():
        want_pair = hf(**{k: torch.tensor([v]) for k, v in pair.items()}, output_hidden_states=True)
        want_single = hf(input_ids=torch.tensor([single["input_ids"]]), output_hidden_states=True)
    n = len(pair["input_ids"])
    close(hidden[:n], want_pair.hidden_states[-1][0])
    close(hidden[n:], want_single.hidden_states[-1][0])
    close(no_types[n:], hidden[n:])
    assert not torch.allclose(no_types[:n], hidden[:n], atol=1e-3)
    close(model.score(hidden[:1]), want_pair.logits)  # the cross-encoder score of the pair


def test_xlm_roberta_positions_skip_pad_tokens_as_hf(tmp_path):
    """HF numbers RoBERTa positions from pad_token_id + 1 and skips pad tokens inside the input."""
    path = make_tiny_encoder("xlm-roberta", tmp_path / "xlmr")
    model = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    hf = hf_model(path, False)
    prompts = [[0, 5, 1, 1, 6, 2], [0, 9, 2]]  # pad (1) inside the first prompt
    hidden = run(model, prompts)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompts[0]]), attention_mask=torch.ones(1, 6, dtype=torch.long))
    close(hidden[:6], want.last_hidden_state[0])
    assert model.max_model_len == 64  # 66 position rows, the first two before pad_token_id + 1


def test_no_kv_cache_is_read_or_written(checkpoint):
    """Every attention goes through encoder_attention; write_kv / paged_attention are never called."""
    kind, _, path = checkpoint
    calls = []

    class Spy:
        def __getattr__(self, name):
            hook = getattr(get_backend("cpu"), name)

            def record(*a, **k):
                calls.append(name)
                return hook(*a, **k)
            return record

    model = load_model(path, backend=Spy(), dtype=torch.float32, device=torch.device("cpu"))
    run(model, PROMPTS[kind][:2])
    assert calls and set(calls) == {"encoder_attention"}, set(calls)
    assert calls.count("encoder_attention") == model.num_layers


def test_architectures_registered_and_refusals(tmp_path):
    path = make_tiny_encoder("bert", tmp_path / "bert")
    config = load_config(path)
    name, spec = architecture_of(config)
    assert (name, spec.module) == ("BertModel", "bert")
    config.is_decoder = True
    with pytest.raises(UnsupportedModelError, match="is_decoder"):
        load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"), config=config)
    with pytest.raises(UnsupportedModelError, match="unquantized safetensors"):
        load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                   quantization="fp8")


def test_padded_step_gives_the_same_rows(checkpoint):
    """A static-shape step: padding tokens (id 0, position 0) after the prompts and padding sequences with no tokens
    (the model runner's padding) leave every real row as it was."""
    kind, _, path = checkpoint
    model = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    prompts = PROMPTS[kind][:2]
    want = run(model, prompts)
    n, pad = sum(map(len, prompts)), 5
    ids = torch.tensor([t for p in prompts for t in p] + [0] * pad)
    positions = torch.cat([torch.arange(len(p)) for p in prompts] + [torch.zeros(pad, dtype=torch.long)])
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens + [0, 0], lens + [0, 0], [[] for _ in range(4)], 16,
                                   slot_mapping=[-1] * (n + pad))
    meta.extra["token_type_ids"] = torch.zeros(n, dtype=torch.long)  # only the real tokens' types
    with torch.inference_mode():
        got = model(ids, positions, meta)
    assert got.shape == (n + pad, model.hidden_size)
    close(got[:n], want)


def test_head_model_checkpoint_names_load(tmp_path):
    """A classifier saved under ``bert.`` with TF-era ``LayerNorm.gamma`` / ``.beta`` names (HF renames them on load)
    and a stray ``position_ids`` buffer loads and equals HF; a missing tensor is named."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_encoder("bert", tmp_path / "bert", classification=True, num_labels=2)
    file = tmp_path / "bert" / "model.safetensors"
    sd = load_file(file)
    assert all(k.startswith(("bert.", "classifier.")) for k in sd)
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in sd.items()}
    renamed["bert.embeddings.position_ids"] = torch.arange(64)[None]
    save_file(renamed, file, metadata={"format": "pt"})
    model = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    save_file(sd, file, metadata={"format": "pt"})  # HF's oracle reads the original names
    hf = hf_model(path, True)
    prompt = PROMPTS["bert"][0]
    hidden = run(model, [prompt])
    with torch.no_grad():
        close(model.score(hidden[:1]), hf(input_ids=torch.tensor([prompt])).logits)
    del sd["classifier.weight"]
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="classifier.weight"):
        load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))


def test_bfloat16_stays_close_to_float32(tmp_path):
    """``dtype=bfloat16`` (weights, activations and the fused SDPA in bf16) within bf16 rounding of the fp32 run."""
    path = make_tiny_encoder("bert", tmp_path / "bert")
    cpu = get_backend("cpu")
    f32 = load_model(path, backend=cpu, dtype=torch.float32, device=torch.device("cpu"))
    bf16 = load_model(path, backend=cpu, dtype=torch.bfloat16, device=torch.device("cpu"))
    want, got = run(f32, PROMPTS["bert"]), run(bf16, PROMPTS["bert"])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-1, rtol=5e-2)
