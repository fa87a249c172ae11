"""LoRA through the real ``pagedllm serve`` process and the official ``openai`` client: adapters selected by
``model=``, listed in /v1/models, an unknown one a 404 in OpenAI's shape, runtime load/unload only behind
``--allow-runtime-lora-updating``. Oracle: peft's greedy tokens for each adapter."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import API_KEY, ServerProcess, tiny_chat_model

import hf_oracle
from lora_utils import peft_model, write_adapter

PROMPT = [1, 520, 33, 977, 4096, 12, 88]


@pytest.fixture(scope="module")
def model_path() -> str:
    return tiny_chat_model()


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_server")
    return {"sql": write_adapter(model_path, root / "sql", seed=1, r=8, lora_alpha=16,
                                 target_modules=["q_proj", "v_proj", "down_proj"]),
            "chat": write_adapter(model_path, root / "chat", seed=2, r=4, lora_alpha=8, use_rslora=True,
                                  target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
            "late": write_adapter(model_path, root / "late", seed=3, r=16, lora_alpha=16,
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])}


@pytest.fixture(scope="module")
def server(model_path, adapters):
    srv = ServerProcess(model_path, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                        "--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}",
                        "--allow-runtime-lora-updating")
    yield srv
    srv.stop()


def greedy_ids(client: openai.OpenAI, model: str, n: int = 6) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.model == model  # an adapter's responses name the adapter, as vLLM's do
    return r.choices[0].model_extra["token_ids"]


def want(model_path: str, adapter: str, n: int = 6) -> list[int]:
    return hf_oracle.hf_greedy(peft_model(model_path, adapter), PROMPT, n)


def test_adapters_selected_by_name(server, adapters, model_path):
    client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
    ids = [m.id for m in client.models.list().data]
    assert ids == ["test-model", "sql", "chat"]
    assert client.models.retrieve("sql").root == "sql"  # a name, never the folder (issue 34)
    assert all(adapters[n] not in m.model_dump_json() for m in client.models.list().data for n in adapters)
    got = {name: greedy_ids(client, name) for name in ("sql", "chat")}
    for name, ids_ in got.items():
        assert ids_ == want(model_path, adapters[name]), name
    from lora_utils import base_model

    assert greedy_ids(client, "test-model") == hf_oracle.hf_greedy(base_model(model_path), PROMPT, 6)
    assert got["sql"] != got["chat"]
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.model == "chat"
    chunks = list(client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, stream=True))
    assert chunks and {c.model for c in chunks} == {"sql"}
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    body = e.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model" and "no-such-adapter" in body["message"]


def test_runtime_load_and_unload(server, adapters, model_path, tmp_path):
    client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
    h = server.headers()
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", headers=h,
                   json={"lora_name": "late", "lora_path": adapters["late"]}, timeout=60)
    assert r.status_code == 200, r.text
    assert "late" in [m.id for m in client.models.list().data]
    assert greedy_ids(client, "late") == want(model_path, adapters["late"])
    # A bad folder: 400 naming lora_path (the reason is in the server's log only), the server keeps serving.
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", headers=h,
                   json={"lora_name": "ghost", "lora_path": str(tmp_path / "missing")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "missing" not in r.json()["error"]["message"] and "does not exist" in server.output()
    r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", headers=h, json={"lora_name": "late"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert greedy_ids(client, "sql") == want(model_path, adapters["sql"])
    # Three adapters went through 2 slots: the swaps are in /metrics, with vLLM's lora_requests_info gauge.
    text = httpx.get(f"{server.base_url}/metrics", timeout=10, headers=h).text
    metrics = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedllm:lora")}
    info = [k for k in metrics if k.startswith("pagedllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info
    slot_loads = next(v for k, v in metrics.items() if k.startswith("pagedllm:lora_slot_loads_total"))
    assert slot_loads >= 3


def test_runtime_updating_refused_without_flag(model_path, adapters):
    srv = ServerProcess(model_path, "--enable-lora", "--lora-modules", f"sql={adapters['sql']}")
    try:
        for path, body in (("load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}),
                           ("unload_lora_adapter", {"lora_name": "sql"})):
            r = httpx.post(f"{srv.base_url}/v1/{path}", headers=srv.headers(), json=body, timeout=60)
            assert r.status_code == 404
            assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=srv.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
        assert greedy_ids(client, "sql") == want(model_path, adapters["sql"])
    finally:
        srv.stop()
