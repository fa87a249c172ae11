"""Encoder models end to end through ``LLM(..., runner="pooling")``: embeddings equal sentence-transformers (CLS and
MEAN folders, normalized or not), classification probabilities and cross-encoder scores equal HF transformers (the
pair's token types reach the model), XLM-RoBERTa from token ids; no KV blocks are ever allocated, and a prompt over
the step budget is refused naming it."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams
from pagedllm.errors import ParamError
from tiny_encoders import make_tiny_encoder

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "dog", "how many red trees are over the big river"]
ATOL = RTOL = 1e-4
ENGINE = dict(runner="pooling", device="cpu", dtype="float32", max_num_seqs=8)


def close(a, b) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("pooling,normalize", [("cls", True), ("mean", False)])
def test_embed_equals_sentence_transformers(tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    path = make_tiny_encoder("bert", tmp_path / "st", pooling=pooling, normalize=normalize)
    want = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    llm = LLM(model=path, **ENGINE)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    close(got, want)
    assert llm.llm_engine.worker.num_blocks == 0 and llm.llm_engine.worker.kv_caches == []
    # Matryoshka-style truncation on the same engine: the first 16 values, renormalized
    short = llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    close(short[0].outputs.embedding, torch.nn.functional.normalize(want[0, :16], dim=-1))


@pytest.mark.slow
def test_bert_without_st_config_pools_cls(tmp_path):
    """No sentence-transformers files: the model's default pooling (CLS), normalized (vLLM's embed default)."""
    from transformers import AutoModel, AutoTokenizer

    path = make_tiny_encoder("bert", tmp_path / "bert")
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=path, **ENGINE)
    got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    for text, emb in zip(TEXTS, got):
        with torch.no_grad():
            cls_row = hf(**tok(text, return_tensors="pt")).last_hidden_state[0, 0]
        close(emb, torch.nn.functional.normalize(cls_row, dim=-1))


@pytest.mark.slow
def test_classify_and_cross_encoder_score_equal_hf(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    clf_path = make_tiny_encoder("bert", tmp_path / "clf", classification=True, num_labels=3)
    tok = AutoTokenizer.from_pretrained(clf_path)
    hf = AutoModelForSequenceClassification.from_pretrained(clf_path, dtype=torch.float32).eval()
    probs = [o.outputs.probs for o in LLM(model=clf_path, **ENGINE).classify(TEXTS, use_tqdm=False)]
    for text, p in zip(TEXTS, probs):
        with torch.no_grad():
            close(p, hf(**tok(text, return_tensors="pt")).logits[0].softmax(-1))

    ce_path = make_tiny_encoder("bert", tmp_path / "ce", classification=True, num_labels=1, seed=3)
    ce = AutoModelForSequenceClassification.from_pretrained(ce_path, dtype=torch.float32).eval()
    query, docs = TEXTS[1], [TEXTS[0], TEXTS[3], "what is the capital of france"]
    scores = [o.outputs.score for o in LLM(model=ce_path, **ENGINE).score(query, docs, use_tqdm=False)]
    with torch.no_grad():
        pairs = tok([query] * len(docs), docs, return_tensors="pt", padding=True)
        assert pairs["token_type_ids"].any()  # the second segment is typed 1: it must reach the model
        want = ce(**pairs).logits[:, 0].sigmoid()
    close(scores, want)


@pytest.mark.slow
def test_xlm_roberta_from_token_ids_and_refusals(tmp_path):
    """No tokenizer (XLM-R's is SentencePiece): prompts as token ids. Classification probabilities equal HF; a prompt
    longer than the step budget is refused naming max_num_batched_tokens, since an encoder runs it whole."""
    from transformers import AutoModelForSequenceClassification

    path = make_tiny_encoder("xlm-roberta", tmp_path / "xlmr", classification=True, num_labels=2)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[0, 10, 11, 12, 2], [0, 7, 2], list(range(3, 40)) + [2]]
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_batched_tokens=32, **ENGINE)
    assert llm.llm_engine.max_model_len == 64  # 66 position rows: positions start past pad_token_id
    probs = [o.outputs.probs for o in llm.classify([{"prompt_token_ids": p} for p in prompts[:2]], use_tqdm=False)]
    for p, got in zip(prompts, probs):
        with torch.no_grad():
            close(got, hf(input_ids=torch.tensor([p])).logits[0].softmax(-1))
    with pytest.raises(ParamError, match="max_num_batched_tokens is 32"):
        llm.classify([{"prompt_token_ids": prompts[2]}], use_tqdm=False)
    with pytest.raises(ParamError, match="runner"):
        LLM(model=path, skip_tokenizer_init=True, device="cpu", dtype="float32", runner="generate")


@pytest.mark.slow
def test_static_shape_backend_equals_dynamic(tmp_path):
    """cpu-static pads every step to buckets (padding tokens and empty sequences) and warms every bucket up without
    sampling: the same probabilities as the dynamic cpu backend."""
    path = make_tiny_encoder("xlm-roberta", tmp_path / "xlmr", classification=True, num_labels=2)
    # 17 tokens in 3 sequences: padded to a 32-token, 4-sequence bucket
    prompts = [{"prompt_token_ids": p} for p in ([0, 10, 11, 12, 2], [0, 7, 2], [0, 7, 8, 9, 10, 11, 12, 13, 2])]
    common = dict(model=path, runner="pooling", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=64,
                  max_num_seqs=4)
    dynamic = [o.outputs.probs for o in LLM(device="cpu", **common).classify(prompts, use_tqdm=False)]
    static = LLM(device="cpu-static", **common)
    assert static.llm_engine.worker.graph_level == "full"
    close([o.outputs.probs for o in static.classify(prompts, use_tqdm=False)], dynamic)
