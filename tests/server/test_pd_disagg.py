"""Prefill/decode disaggregation (docs/kv-offload.md): a ``kv_producer`` server, a ``kv_consumer`` server on one
shared folder (``LoopbackConnector``) and ``pagedllm router`` in front, as real processes on 127.0.0.1. Greedy output
through the router equals a colocated engine's, the decode instance loads the prompt's blocks instead of computing
them (its connector hits), and every fault (a backend killed or restarting, a stale, corrupted or truncated transfer)
ends in a recompute with the same output or a 503 in the OpenAI shape, with nothing left held or stored."""

from __future__ import annotations

import glob
import os
import tempfile
import threading
import time

import httpx
import openai
import pytest
import torch
from pd_processes import AUTH, BS, Router, loopback_config
from server_utils import API_KEY, ServerProcess, free_port, metrics, tiny_chat_model, wait_idle

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

TTL_S = 3.0


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Backend:
    """A serve process on a fixed port (so it can be killed and started again where the router expects it)."""

    def __init__(self, role: str, store: str):
        self.role, self.store, self.port = role, store, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.start()

    def start(self) -> None:
        self.server = ServerProcess(tiny_chat_model(), "--max-model-len", "512", "--block-size", str(BS),
                                    "--kv-transfer-config", loopback_config(self.role, self.store, TTL_S),
                                    port=self.port)

    def kill(self) -> None:
        self.server.proc.kill()
        self.server.proc.wait(10)
        self.server.stop()  # (its log)


@pytest.fixture(scope="module")
def pd():
    store = tempfile.mkdtemp(prefix="pagedllm-pd-")
    started: dict[str, Backend] = {}
    threads = [threading.Thread(target=lambda r=r: started.__setitem__(r, Backend(r, store)))
               for r in ("kv_producer", "kv_consumer")]  # both start at once: the module's setup is most of its time
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p, d = started["kv_producer"], started["kv_consumer"]
    router = Router(p.url, d.url)
    try:
        yield p, d, router, store
    finally:
        router.stop()
        for b in (p, d):
            b.server.stop()


@pytest.fixture(scope="module")
def colocated():
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=512)

    def run(prompt: list[int], n: int) -> list[int]:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    yield run
    llm.llm_engine.shutdown()


def files(store: str) -> list[str]:
    return glob.glob(os.path.join(store, "*", "*", "*.kvb"))


def complete(url: str, prompt: list[int], n: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "test-model", "prompt": prompt, "max_tokens": n, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, **extra})


def hits(d: Backend) -> float:
    return metrics(d.url)["pagedllm:kv_offload_hits_total"]


def test_router_output_equals_colocated_and_decode_loads_the_prompt(pd, colocated):
    p, d, router, store = pd
    prompt = ids(1, 100)  # 6 full blocks the decode instance may load (the last token is always computed)
    before = hits(d)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="test-model", prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].token_ids == colocated(prompt, 8)
    assert hits(d) - before == (len(prompt) - 1) // BS  # 96 prompt tokens loaded, not recomputed
    m = wait_idle(d.url)
    assert m["pagedllm:kv_offload_load_errors_total"] == 0 and m["pagedllm:kv_offload_recomputes_total"] == 0
    assert wait_idle(p.url)["pagedllm:kv_cache_used_blocks"] == 0
    assert files(store) == []  # the decode instance consumed what it loaded

    # streamed through, and chat: the same text as the prefill instance computing it alone
    prompt2 = ids(2, 70)
    chunks = client.completions.create(model="test-model", prompt=prompt2, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == \
        complete(p.url, prompt2, 6).json()["choices"][0]["text"]
    msgs = [{"role": "user", "content": "Tell me about the moon and the tides. " * 6}]
    before = hits(d)
    chat = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=6, temperature=0)
    assert hits(d) > before
    alone = httpx.post(f"{p.url}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"model": "test-model", "messages": msgs, "max_tokens": 6, "temperature": 0}).json()
    assert chat.choices[0].message.content == alone["choices"][0]["message"]["content"]
    streamed = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=6, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == ["test-model"]


def test_prefill_answer_carries_kv_transfer_params(pd):
    p, d, router, store = pd
    r = complete(p.url, ids(3, 40), 1, kv_transfer_params={"do_remote_decode": True})
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["block_hashes"]) == 2 and len(params["remote_block_ids"]) == 2
    assert {"remote_engine_id", "remote_host", "remote_port", "remote_request_id"} <= set(params)
    assert len(files(store)) >= 2
    # a bad kv_transfer_params is a 4xx naming the field
    bad = complete(d.url, ids(3, 40), 2, kv_transfer_params="nope")
    assert bad.status_code == 400 and "kv_transfer_params" in str(bad.json()["error"]), bad.text


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_transfer_is_recomputed_with_the_same_output(pd, colocated, damage):
    p, d, router, store = pd
    prompt = ids(10 + len(damage), 60)
    params = complete(p.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    victim = next(f for f in files(store) if os.path.basename(f).startswith(params["block_hashes"][1]))
    with open(victim, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(victim) - 100)
        else:
            f.seek(-50, os.SEEK_END)
            byte = f.read(1)
            f.seek(-50, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    m0 = metrics(d.url)
    r = complete(d.url, prompt, 8, kv_transfer_params=params)
    assert r.json()["choices"][0]["token_ids"] == colocated(prompt, 8)
    m = wait_idle(d.url)
    assert m["pagedllm:kv_offload_hits_total"] - m0["pagedllm:kv_offload_hits_total"] == 1  # block 0 loaded
    assert m["pagedllm:kv_offload_recomputes_total"] - m0["pagedllm:kv_offload_recomputes_total"] == 1
    mine = [f for f in files(store) if os.path.basename(f)[:64] in params["block_hashes"]]
    assert not os.path.exists(victim) and mine == []  # the bad file dropped, the good one consumed


def test_stale_params_after_the_prefill_instance_died_are_a_recompute(pd, colocated):
    p, d, router, store = pd
    prompt = ids(20, 50)
    params = complete(p.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}).json()["kv_transfer_params"]
    p.kill()
    try:
        for f in files(store):  # what the dead instance wrote is gone (expired, or its folder was lost)
            os.unlink(f)
        before = hits(d)
        r = complete(d.url, prompt, 8, kv_transfer_params=params)
        assert r.json()["choices"][0]["token_ids"] == colocated(prompt, 8) and hits(d) == before
        t0 = time.monotonic()
        down = complete(router.url, prompt, 4)  # the prefill instance is down: a clear 503 after bounded retries
        assert down.status_code == 503 and time.monotonic() - t0 < 15
        err = down.json()["error"]
        assert err["type"] == "service_unavailable_error" and "prefill" in err["message"]
        assert httpx.get(f"{router.url}/health", timeout=15).status_code == 503
    finally:
        p.start()
    r = complete(router.url, prompt, 8)  # restarted where the router expects it: served again
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated(prompt, 8)


def test_decode_killed_mid_request_is_a_503_and_nothing_leaks(pd):
    p, d, router, store = pd
    result = {}

    def call():
        result["r"] = httpx.post(f"{router.url}/v1/completions", headers=AUTH, timeout=60,
                                 json={"model": "test-model", "prompt": ids(30, 40), "max_tokens": 400,
                                       "temperature": 0, "ignore_eos": True})
    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metrics(d.url)["pagedllm:num_requests_running"] == 0:
        time.sleep(0.02)
    d.kill()
    try:
        t.join(30)
        assert not t.is_alive()
        r = result["r"]
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
        m = wait_idle(p.url)
        assert m["pagedllm:kv_cache_used_blocks"] == 0 and m["pagedllm:num_requests_running"] == 0
    finally:
        d.start()
    deadline = time.monotonic() + 6 * TTL_S
    while time.monotonic() < deadline:  # never consumed: the files expire (bound + TTL on both sides)
        if not files(store):
            break
        complete(d.url, ids(31, 4), 1)  # any step sweeps
        time.sleep(0.5)
    assert files(store) == []
    assert httpx.get(f"{router.url}/health", timeout=15).status_code == 200


def test_offline_hand_off_with_a_shared_prefix_loads_once_per_request(colocated, tmp_path):
    """``LLM(kv_transfer_config=...)``: two requests sharing a prefix are decoded in one step on D, both load."""
    def engine(role: str) -> LLM:
        return LLM(tiny_chat_model(), device="cpu", max_model_len=512, kv_transfer_config={
            "kv_connector": "LoopbackConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    prefix = ids(40, 48)
    prompts = [prefix + ids(41, 20), prefix + ids(42, 25)]
    p = engine("kv_producer")
    one = SamplingParams(temperature=0, max_tokens=1)
    params = [o.kv_transfer_params for o in p.generate([{"prompt_token_ids": q} for q in prompts], one, use_tqdm=False)]
    p.llm_engine.shutdown()
    assert [len(x["block_hashes"]) for x in params] == [4, 4] and len(files(str(tmp_path))) == 5
    d = engine("kv_consumer")
    outs = d.generate([{"prompt_token_ids": q} for q in prompts],
                      [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                      extra_args={"kv_transfer_params": x}) for x in params], use_tqdm=False)
    st = d.llm_engine.get_stats().kv_offload
    d.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [colocated(q, 6) for q in prompts]
    assert st["load_failures"] == 0 and st["loaded_tokens"] == 8 * BS and files(str(tmp_path)) == []
