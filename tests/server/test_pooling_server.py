"""The pooling endpoints end to end: a real ``pagedllm serve`` process on 127.0.0.1, the official ``openai`` client
and plain HTTP, against the offline ``LLM.embed`` / ``LLM.classify`` / ``LLM.score`` on the same checkpoints (whose
own parity with HF transformers and sentence-transformers is tests/core/test_pooling_*.py's).

Servers: the tiny chat Llama turned into an embedding model (``--convert embed``), tiny random
``LlamaForSequenceClassification`` checkpoints with SmolLM2's tokenizer (3 labels: ``/classify``; 1 label: a
cross-encoder for ``/score`` and ``/rerank``), a tiny BERT cross-encoder (encoder-only; its pair's segment ids,
against HF) and the plain chat model (generation only: the pooling routes are refused by name).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from lora_utils import write_adapter
from pagedllm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pooling_models import make_seq_cls_model
from server_utils import API_KEY, ServerProcess, metrics, tiny_chat_model, wait_idle
from tiny_encoders import make_tiny_encoder

pytestmark = pytest.mark.slow

MAX_LEN = 128
TEXTS = ["The capital of France is Paris.", "Llamas live in the Andes.", "pagedllm pools hidden states",
         "A fourth, somewhat longer sentence about embeddings and retrieval."]
QUERY = "Where do llamas live?"
DOCS = ["Paris is in France.", "Llamas live high in the Andes mountains.", "Embeddings map text to vectors.",
        "The Andes are in South America."]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
ENGINE = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory", str(32 << 20)]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return write_adapter(tiny_chat_model(), tmp_path_factory.mktemp("lora") / "sql", seed=1, r=8, lora_alpha=16,
                         target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def embed_server(adapter):
    s = ServerProcess(tiny_chat_model(), "--convert", "embed", *ENGINE, "--enable-lora", "--lora-modules",
                      f"sql={adapter}")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def embed_llm():
    return LLM(tiny_chat_model(), device="cpu", convert="embed", max_model_len=MAX_LEN, kv_cache_memory=32 << 20,
               enable_lora=True)


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory):
    return make_seq_cls_model("llama", tmp_path_factory.mktemp("cls3"), 3, tokenizer=True, id2label=LABELS,
                              label2id={v: k for k, v in LABELS.items()})


@pytest.fixture(scope="module")
def cross_encoder_path(tmp_path_factory):
    return make_seq_cls_model("llama", tmp_path_factory.mktemp("cls1"), 1, tokenizer=True)


@pytest.fixture(scope="module")
def generate_server():
    s = ServerProcess(tiny_chat_model(), *ENGINE)
    yield s
    s.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0)


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=60)


def _error(r: httpx.Response, status: int, param: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert param in err["message"], err
    return err


def _close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), atol=atol,
                               rtol=1e-4)


# ---- embeddings -------------------------------------------------------------------------------------------------
def test_embeddings_float_and_base64_equal_offline(embed_server, embed_llm):
    want = [o.outputs.embedding for o in embed_llm.embed(TEXTS, use_tqdm=False)]
    client = _client(embed_server)
    floats = client.embeddings.create(model="test-model", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for d, w in zip(floats.data, want):
        _close(d.embedding, w)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4  # embed normalises by default
    n = sum(len(o.prompt_token_ids) for o in embed_llm.embed(TEXTS, use_tqdm=False))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    assert floats.model == "test-model" and floats.object == "list"
    # the client's default asks for base64 and decodes it itself
    default = client.embeddings.create(model="test-model", input=TEXTS[0])
    _close(default.data[0].embedding, want[0])
    b64 = client.embeddings.create(model="test-model", input=TEXTS[:2], encoding_format="base64")
    for d, w in zip(b64.data, want):
        assert isinstance(d.embedding, str)
        _close(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"), w)


def test_embeddings_token_ids_and_single_string(embed_server, embed_llm):
    tok = embed_llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS[:2]]
    want = [o.outputs.embedding for o in embed_llm.embed(TEXTS[:2], use_tqdm=False)]
    client = _client(embed_server)
    got = client.embeddings.create(model="test-model", input=ids, encoding_format="float")
    for d, w in zip(got.data, want):
        _close(d.embedding, w)
    one = client.embeddings.create(model="test-model", input=ids[1], encoding_format="float", user="u-1")
    _close(one.data[0].embedding, want[1])


def test_embeddings_dimensions(embed_server, embed_llm):
    want = embed_llm.embed(TEXTS[:2], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    got = _client(embed_server).embeddings.create(model="test-model", input=TEXTS[:2], dimensions=16,
                                                  encoding_format="float")
    for d, w in zip(got.data, want):
        assert len(d.embedding) == 16
        _close(d.embedding, w.outputs.embedding)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4  # truncated, then renormalised
    err = _error(_post(embed_server, "/v1/embeddings", {"input": "x", "dimensions": 65}), 400, "dimensions")
    assert "64" in err["message"]  # the hidden size, the most it can be
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "dimensions": 0}), 400, "dimensions")


def test_embeddings_chat_messages(embed_server, embed_llm):
    tok = embed_llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    want = embed_llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    r = _post(embed_server, "/v1/embeddings", {"model": "test-model", "messages": messages})
    assert r.status_code == 200, r.text
    _close(r.json()["data"][0]["embedding"], want.outputs.embedding)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_embeddings_of_a_lora_adapter(embed_server, embed_llm, adapter):
    """``model`` naming a served adapter embeds with it (as offline ``lora_request``), and the response names it."""
    want = embed_llm.embed(TEXTS[:2], lora_request=LoRARequest("sql", 1, adapter), use_tqdm=False)
    base = embed_llm.embed(TEXTS[:2], use_tqdm=False)
    got = _client(embed_server).embeddings.create(model="sql", input=TEXTS[:2], encoding_format="float")
    assert got.model == "sql"
    for d, w, b in zip(got.data, want, base):
        _close(d.embedding, w.outputs.embedding)
        assert np.abs(np.asarray(w.outputs.embedding) - np.asarray(b.outputs.embedding)).max() > 1e-2


def test_embeddings_bad_input(embed_server):
    s = embed_server
    _error(_post(s, "/v1/embeddings", {"input": ""}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": []}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": ["ok", ""]}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": 5}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": [[1, 2], []]}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": [10 ** 7]}), 400, "input")
    _error(_post(s, "/v1/embeddings", {}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}), 400, "input")
    _error(_post(s, "/v1/embeddings", {"input": "x", "encoding_format": "int8"}), 400, "encoding_format")
    _error(_post(s, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}), 400, "truncate_prompt_tokens")
    err = _error(_post(s, "/v1/embeddings", {"input": list(range(1, MAX_LEN + 2))}), 400, "input")
    assert str(MAX_LEN) in err["message"] and err["code"] == "context_length_exceeded"
    err = _error(_post(s, "/v1/embeddings", {"input": "word " * (2 * MAX_LEN)}), 400, "input")
    assert str(MAX_LEN) in err["message"]
    ok = _post(s, "/v1/embeddings", {"input": "word " * (2 * MAX_LEN), "truncate_prompt_tokens": 8})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 8
    r = _post(s, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(s.base_url + "/v1/embeddings", json={"input": "x"}, timeout=10)  # no key
    assert r.status_code == 401 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        _client(s).embeddings.create(model="test-model", input="")
    assert e.value.body["param"] == "input"


def test_pooling_model_refuses_other_tasks(embed_server):
    err = _error(_post(embed_server, "/classify", {"input": "x"}), 400, "model")
    assert "test-model" in err["message"] and "--convert classify" in err["message"]


def test_mixed_generation_and_embedding_load(embed_server, embed_llm):
    """Issue 30: one server (a causal LM with --convert embed keeps its LM head) takes generation and embedding
    requests at once: every one succeeds, greedy completions equal the same server's idle answer, embeddings equal
    offline, and afterwards no KV block is held and nothing runs."""
    from concurrent.futures import ThreadPoolExecutor

    gen = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0}
    idle = _post(embed_server, "/v1/completions", gen).json()["choices"][0]["text"]
    want = [o.outputs.embedding for o in embed_llm.embed(TEXTS, use_tqdm=False)]

    def one(i: int):
        kind = i % 3
        if kind == 0:
            return kind, _post(embed_server, "/v1/completions", gen)
        if kind == 1:
            return kind, _post(embed_server, "/v1/chat/completions", chat)
        return kind, _post(embed_server, "/v1/embeddings", {"model": "test-model", "input": TEXTS})

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(36)))
    for kind, r in results:
        assert r.status_code == 200, r.text
        if kind == 0:
            assert r.json()["choices"][0]["text"] == idle
        elif kind == 2:
            for d, w in zip(r.json()["data"], want):
                _close(d["embedding"], w)
    m = wait_idle(embed_server.base_url)
    assert m["pagedllm:kv_cache_used_blocks"] == 0 and m["pagedllm:num_requests_running"] == 0


def test_pooling_endpoint(embed_server, embed_llm):
    want = embed_llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding
    r = _post(embed_server, "/pooling", {"input": TEXTS[0], "task": "embed"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["data"][0]["object"] == "pooling"
    _close(body["data"][0]["data"], want)


def test_bi_encoder_score_and_rerank(embed_server, embed_llm):
    want = [o.outputs.score for o in embed_llm.score(QUERY, DOCS, use_tqdm=False)]
    r = _post(embed_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    _close([d["score"] for d in r.json()["data"]], want)
    r = _post(embed_server, "/rerank", {"query": QUERY, "documents": DOCS})
    assert [x["index"] for x in r.json()["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])


def test_many_concurrent_embeddings_leave_nothing_held(embed_server, embed_llm):
    want = [o.outputs.embedding for o in embed_llm.embed(TEXTS, use_tqdm=False)]
    errors: list[str] = []

    def worker(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            for j in range(4):
                i = (k + j) % len(TEXTS)
                r = c.post(embed_server.base_url + "/v1/embeddings", headers=embed_server.headers(),
                           json={"input": [TEXTS[i], TEXTS[(i + 1) % len(TEXTS)]]})
                if r.status_code != 200:
                    errors.append(r.text)
                    continue
                try:
                    _close(r.json()["data"][0]["embedding"], want[i])
                except AssertionError as e:
                    errors.append(str(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    m = wait_idle(embed_server.base_url)
    assert m["pagedllm:kv_cache_used_blocks"] == 0
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:request_success_total"] >= 12 * 4 * 2  # one per input, counted as "stop"


def test_fuzzed_pooling_routes_answer_their_schema(embed_server):
    """schemathesis' valid and invalid bodies for each pooling route (as test_server_schema.py does for every route of
    a generation server): a declared status, a body matching the declared model, never a 5xx; nothing held after."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(f"{embed_server.base_url}/openapi.json", headers=embed_server.headers())
    paths = {"/v1/embeddings", "/pooling", "/classify", "/score", "/v1/rerank"}
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path in paths]
    assert {op.path for op in operations} == paths
    before = metrics(embed_server.base_url).get("pagedllm:request_success_total", 0.0)
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=20, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case):
                case.call_and_validate(base_url=embed_server.base_url, headers=embed_server.headers(), checks=checks,
                                       timeout=30)

            run()
    m = wait_idle(embed_server.base_url)
    assert (m["pagedllm:num_requests_running"], m["pagedllm:kv_cache_used_blocks"]) == (0, 0)
    assert m["pagedllm:request_success_total"] > before  # valid bodies were served, not only refused


# ---- classification and cross-encoder scores ---------------------------------------------------------------------
def test_classify_equals_offline(classifier_path):
    llm = LLM(classifier_path, device="cpu", max_model_len=MAX_LEN, kv_cache_memory=32 << 20)
    want = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    del llm
    s = ServerProcess(classifier_path, *ENGINE)
    try:
        r = _post(s, "/classify", {"model": "test-model", "input": TEXTS})
        assert r.status_code == 200, r.text
        body = r.json()
        for d, w in zip(body["data"], want):
            _close(d["probs"], w)
            assert d["num_classes"] == 3 and abs(sum(d["probs"]) - 1) < 1e-5
            assert d["label"] == LABELS[int(np.argmax(w))]
        assert body["usage"]["prompt_tokens"] > 0
        _error(_post(s, "/classify", {"input": []}), 400, "input")
        err = _error(_post(s, "/v1/embeddings", {"input": "x"}), 400, "model")
        assert "--convert embed" in err["message"]
        err = _error(_post(s, "/score", {"text_1": "a", "text_2": "b"}), 400, "model")  # 3 labels: no score
        assert "test-model" in err["message"]
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),  # no LM head: no generation
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            err = _error(_post(s, path, body), 400, "model")
            assert "test-model" in err["message"] and "no LM head" in err["message"]
    finally:
        s.stop()


def test_cross_encoder_score_and_rerank(cross_encoder_path):
    llm = LLM(cross_encoder_path, device="cpu", max_model_len=MAX_LEN, kv_cache_memory=32 << 20)
    want = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    pair = [o.outputs.score for o in llm.score(DOCS[:2], DOCS[2:], use_tqdm=False)]
    del llm
    s = ServerProcess(cross_encoder_path, *ENGINE)
    try:
        r = _post(s, "/score", {"model": "test-model", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert [d["index"] for d in r.json()["data"]] == list(range(len(DOCS)))
        _close([d["score"] for d in r.json()["data"]], want)
        r = _post(s, "/v1/score", {"text_1": DOCS[:2], "text_2": DOCS[2:]})
        _close([d["score"] for d in r.json()["data"]], pair)
        order = sorted(range(len(DOCS)), key=lambda i: -want[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = _post(s, path, {"query": QUERY, "documents": DOCS, "top_n": 3})
            assert r.status_code == 200, r.text
            res = r.json()["results"]
            assert [x["index"] for x in res] == order[:3]
            assert [x["document"]["text"] for x in res] == [DOCS[i] for i in order[:3]]
            _close([x["relevance_score"] for x in res], [want[i] for i in order[:3]])
        r = _post(s, "/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False})
        assert len(r.json()["results"]) == len(DOCS) and "document" not in r.json()["results"][0]
        assert r.json()["usage"]["total_tokens"] > 0
        _error(_post(s, "/score", {"text_1": DOCS[:2], "text_2": DOCS[:3]}), 400, "text_2")
        _error(_post(s, "/score", {"text_1": [], "text_2": DOCS}), 400, "text_1")
        _error(_post(s, "/score", {"text_1": "a", "text_2": 3}), 400, "text_2")
        _error(_post(s, "/rerank", {"query": QUERY, "documents": []}), 400, "documents")
        _error(_post(s, "/rerank", {"query": "", "documents": DOCS}), 400, "query")
        _error(_post(s, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}), 400, "top_n")
        err = _error(_post(s, "/rerank", {"query": "word " * MAX_LEN, "documents": ["x"]}), 400, "documents")
        assert str(MAX_LEN) in err["message"]
        m = wait_idle(s.base_url)
        assert m["pagedllm:kv_cache_used_blocks"] == 0
    finally:
        s.stop()


def test_bert_cross_encoder_rerank_equals_hf(tmp_path):
    """An encoder-only cross-encoder (BERT, no KV cache): the pair's segment ids from the server's tokenisation reach
    the model, so /rerank and /score equal HF's sigmoid of the pair logits."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_tiny_encoder("bert", tmp_path / "ce", classification=True, num_labels=1, seed=3)
    query = "where is the capital of france"
    docs = ["paris is the capital of france", "the cat sat on the mat", "a big red house over the river",
            "what city is in france"]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        pairs = tok([query] * len(docs), docs, return_tensors="pt", padding=True)
        assert pairs["token_type_ids"].any()
        want = hf(**pairs).logits[:, 0].sigmoid().tolist()
    s = ServerProcess(path, "--runner", "pooling", "--dtype", "float32")
    try:
        r = _post(s, "/v1/rerank", {"query": query, "documents": docs})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == sorted(range(len(docs)), key=lambda i: -want[i])
        _close([x["relevance_score"] for x in res], [want[x["index"]] for x in res], atol=1e-4)
        r = _post(s, "/score", {"text_1": query, "text_2": docs})
        _close([d["score"] for d in r.json()["data"]], want, atol=1e-4)
        err = _error(_post(s, "/score", {"text_1": "the cat " * 40, "text_2": "dog"}), 400, "text_1")
        assert "64" in err["message"]  # max_position_embeddings: the model's limit
        m = wait_idle(s.base_url)
        assert m["pagedllm:kv_cache_used_blocks"] == 0
    finally:
        s.stop()


# ---- a generation model --------------------------------------------------------------------------------------
def test_generation_model_refuses_pooling_routes(generate_server):
    for path, body, flag in (("/v1/embeddings", {"input": "x"}, "--convert embed"),
                             ("/pooling", {"input": "x"}, "--runner pooling"),
                             ("/classify", {"input": "x"}, "--convert classify"),
                             ("/score", {"text_1": "a", "text_2": "b"}, "--convert embed"),
                             ("/v1/rerank", {"query": "a", "documents": ["b"]}, "--convert embed")):
        err = _error(_post(generate_server, path, body), 400, "model")
        assert "test-model" in err["message"] and "--runner pooling" in err["message"] and flag in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _client(generate_server).embeddings.create(model="test-model", input="hello")
    assert "--convert embed" in e.value.body["message"]
    r = _post(generate_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_client_disconnect_aborts_every_input(embed_server):
    """A client that goes away mid-batch: the server aborts the batch's engine requests (counted as aborted), holds
    no block afterwards and serves the next request."""
    before = wait_idle(embed_server.base_url)
    body = json.dumps({"input": [f"{i} " + "word " * 100 for i in range(1000)]}).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", embed_server.port)) as sock:
        sock.sendall(head + body)
        time.sleep(0.2)  # being tokenised or queued: far from done (1000 x ~100 tokens take over a second)
    deadline = time.monotonic() + 20
    while (metrics(embed_server.base_url)["pagedllm:request_aborted_total"]
           == before["pagedllm:request_aborted_total"] and time.monotonic() < deadline):
        time.sleep(0.1)
    m = wait_idle(embed_server.base_url)
    assert m["pagedllm:request_aborted_total"] == before["pagedllm:request_aborted_total"] + 1
    assert m["pagedllm:kv_cache_used_blocks"] == 0 and m["pagedllm:num_requests_running"] == 0
    r = _post(embed_server, "/v1/embeddings", {"input": TEXTS[0]})
    assert r.status_code == 200, r.text
