"""Pooling models against their oracles: HF transformers (base models, ``*ForSequenceClassification``, the causal LM
a Qwen3-Reranker is) and sentence-transformers, on tiny random float32 checkpoints. Every engine runs with a small
token budget, so prompts longer than it are pooled across chunked-prefill steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pooling_models
from pagedllm.entrypoints.llm import LLM
from pagedllm.errors import ParamError
from pagedllm.pooling_params import PoolingParams

ATOL = 1e-4
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20, max_num_batched_tokens=8)
PROMPTS = [[7, 30, 41, 99, 5, 6, 200, 17, 3, 64, 88, 12, 9, 301, 45, 2, 77, 19, 401, 23, 8], [11, 12, 13],
           [250, 251, 252, 253, 254, 255, 256, 257, 258, 259]]
TEXTS = ["What is the capital of France?", "Pandas eat bamboo.", "The quick brown fox jumps over the lazy dog."]


def hf_hidden(path: str, ids: list[int]) -> torch.Tensor:
    """The HF base model's final-normed hidden states of one prompt: [T, H]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def pool(h: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling_type]


@pytest.fixture(scope="module")
def causal_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pool_causal")
    return {arch: pooling_models.make_causal_lm(arch, root / arch) for arch in ("llama", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_hf(causal_models, arch, pooling_type):
    path = causal_models[arch]
    with LLM(path, runner="pooling", pooler_config={"pooling_type": pooling_type}, **ENGINE) as llm:
        normed = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        raw = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False,
                        pooling_params=PoolingParams(normalize=False))
        assert llm.llm_engine.get_stats().num_used_blocks == 0
    for p, n, r in zip(PROMPTS, normed, raw):
        ref = pool(hf_hidden(path, p), pooling_type)
        torch.testing.assert_close(torch.tensor(r.outputs.embedding), ref, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(n.outputs.embedding), F.normalize(ref, dim=-1), atol=ATOL, rtol=1e-4)
        assert len(n.outputs.embedding) == ref.shape[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_base_model_checkpoint(causal_models, tmp_path, arch):
    """A ``LlamaModel`` / ``Qwen3Model`` checkpoint (no LM head, unprefixed names): runner auto pools it."""
    from transformers import AutoModel

    path = str(tmp_path / "base")
    AutoModel.from_pretrained(causal_models[arch], dtype=torch.float32).save_pretrained(path)
    with LLM(path, **ENGINE) as llm:
        assert llm.llm_engine.pooling.architecture == {"llama": "LlamaModel", "qwen3": "Qwen3Model"}[arch]
        out = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, out):
        ref = F.normalize(hf_hidden(path, p)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=ATOL, rtol=1e-4)


def test_matryoshka_dimensions(causal_models):
    path = causal_models["qwen3"]
    with LLM(path, convert="embed", **ENGINE) as llm:  # convert alone picks the pooling runner
        out = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False,
                        pooling_params=PoolingParams(dimensions=32))
        with pytest.raises(ParamError, match="dimensions") as e:
            llm.embed({"prompt_token_ids": PROMPTS[0]}, pooling_params=PoolingParams(dimensions=129))
        assert e.value.field == "dimensions"
        assert llm.llm_engine.get_num_unfinished_requests() == 0
    for p, o in zip(PROMPTS, out):
        ref = F.normalize(hf_hidden(path, p)[-1][:32], dim=-1)  # truncate, then renormalize (vLLM)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=ATOL, rtol=1e-4)
    with LLM(path, runner="pooling", pooler_config={"matryoshka_dimensions": [16, 64]}, **ENGINE) as llm:
        assert len(llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False,
                             pooling_params=PoolingParams(dimensions=16))[0].outputs.embedding) == 16
        with pytest.raises(ParamError, match=r"\[16, 64\]"):
            llm.embed({"prompt_token_ids": PROMPTS[1]}, pooling_params=PoolingParams(dimensions=32))


@pytest.mark.parametrize("pooling_type,normalize", [("LAST", True), ("MEAN", False), ("CLS", True)])
def test_sentence_transformers_folder(tmp_path, pooling_type, normalize):
    from sentence_transformers import SentenceTransformer
    from server_utils import tiny_chat_model

    folder = pooling_models.make_st_folder(tiny_chat_model(), tmp_path / "st", pooling_type, normalize)
    oracle = SentenceTransformer(folder, device="cpu")
    ref = torch.stack([oracle.encode(t, convert_to_tensor=True) for t in TEXTS])  # one at a time: no padding
    # modules.json decides the pooling type and whether to normalize (no pooler_config given)
    with LLM(folder, runner="pooling", **ENGINE) as llm:
        assert llm.llm_engine.pooling.pooling_type == pooling_type
        assert llm.llm_engine.pooling.normalize is normalize
        out = llm.embed(TEXTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in out]), ref.float(), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch,num_labels", [("llama", 3), ("qwen3", 3), ("qwen3", 1)])
def test_sequence_classification_matches_hf(tmp_path, arch, num_labels):
    from transformers import AutoModelForSequenceClassification

    path = pooling_models.make_seq_cls_model(arch, tmp_path / "cls", num_labels)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = torch.stack([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    with LLM(path, **ENGINE) as llm:  # runner auto: a *ForSequenceClassification architecture pools
        assert llm.llm_engine.pooling.convert == "classify"
        probs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        raw = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False,
                           pooling_params=PoolingParams(use_activation=False))
        with pytest.raises(ParamError, match="runner"):
            llm.generate({"prompt_token_ids": PROMPTS[1]})
    expected = logits.sigmoid() if num_labels == 1 else logits.softmax(-1)  # vLLM's activation
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]), expected, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=ATOL, rtol=1e-4)


def test_reward_scores_every_token(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = pooling_models.make_seq_cls_model("llama", tmp_path / "prm", 2)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(path, **ENGINE) as llm:
        out = llm.reward([{"prompt_token_ids": p} for p in PROMPTS[:2]], use_tqdm=False)
    for p, o in zip(PROMPTS, out):
        with torch.no_grad():
            ref = hf.score(hf.model(torch.tensor([p])).last_hidden_state[0]).softmax(-1)
        assert o.outputs.data.shape == (len(p), 2)
        torch.testing.assert_close(o.outputs.data, ref, atol=ATOL, rtol=1e-4)


def test_cross_encoder_score(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = pooling_models.make_seq_cls_model("qwen3", tmp_path / "ce", 1, tokenizer=True)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = "what do pandas eat?", ["bamboo shoots", "the stock market", "pandas eat bamboo"]
    with torch.no_grad():  # the pair as the HF tokenizer pairs it
        ref = [hf(torch.tensor([tok(text=query, text_pair=d)["input_ids"]])).logits[0, 0].sigmoid().item()
               for d in docs]
    with LLM(path, **ENGINE) as llm:
        one_to_n = llm.score(query, docs, use_tqdm=False)
        one_to_one = llm.score(query, docs[1], use_tqdm=False)
        n_to_n = llm.score([query] * 3, docs, use_tqdm=False)
        with pytest.raises(ParamError, match="text_2"):
            llm.score([query, query], docs)
    assert [o.outputs.score for o in one_to_n] == pytest.approx(ref, abs=ATOL)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(ref, abs=ATOL)
    assert one_to_one[0].outputs.score == pytest.approx(ref[1], abs=ATOL)


def test_qwen3_reranker_scores_and_order(tmp_path):
    """vLLM's Qwen3-Reranker recipe: the causal LM as a one-label classifier whose score is
    softmax([no, yes])[yes] of the last token's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pooling_models.make_causal_lm("qwen3", tmp_path / "rr", tokenizer=True, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    query = "which animal eats bamboo?"
    docs = ["the giant panda", "a red sports car", "koalas eat eucalyptus", "bamboo forests in China", "tax law"]
    with torch.no_grad():
        ref = []
        for d in docs:
            last = hf(torch.tensor([tok(text=query, text_pair=d)["input_ids"]])).logits[0, -1]
            ref.append(last[[no, yes]].softmax(-1)[1].item())
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "is_original_qwen3_reranker": True}
    with LLM(path, hf_overrides=overrides, **ENGINE) as llm:
        assert llm.llm_engine.pooling.num_labels == 1
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert max(ref) - min(ref) > 1e-3  # (an ordering worth comparing)
    assert scores == pytest.approx(ref, abs=ATOL)
    assert sorted(range(len(docs)), key=lambda i: -scores[i]) == sorted(range(len(docs)), key=lambda i: -ref[i])


def test_bi_encoder_score_is_cosine_of_embeddings(tmp_path):
    from server_utils import tiny_chat_model
    from transformers import AutoTokenizer

    path = tiny_chat_model()
    tok = AutoTokenizer.from_pretrained(path)
    query, docs = TEXTS[0], TEXTS[1:]
    emb = [hf_hidden(path, tok(t)["input_ids"])[-1] for t in [query] + docs]
    ref = [F.cosine_similarity(emb[0], e, dim=0).item() for e in emb[1:]]
    with LLM(path, runner="pooling", **ENGINE) as llm:
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        with pytest.raises(ParamError, match="task"):  # an embedding model has no classifier
            llm.classify(query)
    assert scores == pytest.approx(ref, abs=ATOL)


def test_multi_label_classifier_refuses_score(tmp_path):
    path = pooling_models.make_seq_cls_model("llama", tmp_path / "cls3", 3)
    with LLM(path, **ENGINE) as llm:
        with pytest.raises(ParamError, match="3-label") as e:
            llm.score([1, 2, 3], [4, 5, 6])
        assert e.value.field == "task"
        with pytest.raises(ParamError, match="embed"):
            llm.embed({"prompt_token_ids": PROMPTS[1]})
