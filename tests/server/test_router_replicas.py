"""``pagedllm router --backend URL --backend URL`` over two ``pagedllm serve`` replicas, as real processes on
127.0.0.1 (docs/kv-offload.md, "The router"): greedy output through the router equals a replica's own; cache-aware
routing keeps requests sharing a prefix on one replica (its own prefix-cache counter rises, the other's does not)
while least-loaded spreads them; the load bound sends a request elsewhere when the prefix's replica is flooded; a
replica killed is routed around and receives again after its restart; all down is a 503 in the OpenAI shape."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from pd_processes import AUTH, BS, Instance, ReplicaRouter, router_samples
from server_utils import API_KEY, free_port, metrics, tiny_chat_model

pytestmark = pytest.mark.slow


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(url: str, prompt, n: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "test-model", "prompt": prompt, "max_tokens": n, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, **extra})


def chat(url: str, messages: list, n: int = 6) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": "test-model", "messages": messages, "max_tokens": n, "temperature": 0})


def counter(inst: Instance, name: str) -> float:
    return metrics(inst.url)[f"pagedllm:{name}_total"]


def counters(replicas, name: str) -> list[float]:
    return [counter(r, name) for r in replicas]


@pytest.fixture(scope="module")
def replicas():
    started: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: started.__setitem__(i, Instance())) for i in range(2)]
    for t in threads:  # both start at once: the module's setup is most of its time
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(started), "a replica failed to start"
        yield started
    finally:
        for r in started:
            if r is not None:
                r.stop()


@pytest.fixture(scope="module")
def routers(replicas):
    urls = [r.url for r in replicas]
    aware = ReplicaRouter(urls, "--routing", "cache_aware", "--model", tiny_chat_model(), "--block-size", str(BS),
                          "--balance-abs-threshold", "2")
    try:
        loaded = ReplicaRouter(urls, "--routing", "least_loaded")
    except BaseException:
        aware.stop()
        raise
    try:
        yield aware, loaded
    finally:
        aware.stop()
        loaded.stop()


def test_output_through_the_router_equals_a_replica(replicas, routers):
    a = replicas[0]
    msgs = [{"role": "user", "content": "Tell me about the moon and the tides. " * 4}]
    alone_chat = chat(a.url, msgs).json()["choices"][0]["message"]["content"]
    for router in routers:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        prompt = ids(1, 40)
        out = client.completions.create(model="test-model", prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == complete(a.url, prompt).json()["choices"][0]["token_ids"]
        text = "The quick brown fox jumps over the lazy dog. " * 3
        streamed = client.completions.create(model="test-model", prompt=text, max_tokens=6, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == \
            complete(a.url, text, 6).json()["choices"][0]["text"]
        got = client.chat.completions.create(model="test-model", messages=msgs, max_tokens=6, temperature=0)
        assert got.choices[0].message.content == alone_chat
        assert [m.id for m in client.models.list()] == ["test-model"]
    bad = httpx.post(f"{routers[0].url}/v1/completions", headers=AUTH, content=b"[1, 2", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_cache_aware_keeps_a_shared_prefix_on_one_replica_least_loaded_spreads(replicas, routers):
    aware, loaded = routers
    urls = [r.url for r in replicas]
    prefix = ids(100, 6 * BS)
    hits0, queries0 = counters(replicas, "prefix_cache_hits"), counters(replicas, "prefix_cache_queries")
    for k in range(4):
        assert complete(aware.url, prefix + ids(200 + k, 10), 2).status_code == 200
    hits = [h - h0 for h, h0 in zip(counters(replicas, "prefix_cache_hits"), hits0)]
    queries = [q - q0 for q, q0 in zip(counters(replicas, "prefix_cache_queries"), queries0)]
    home = max(range(2), key=lambda i: queries[i])
    # the first request computed the prefix there; the three after it found its 6 blocks in that replica's cache
    assert hits[home] == 3 * 6 * BS and hits[1 - home] == 0 and queries[1 - home] == 0
    predicted = router_samples(aware.url, "pagedllm:router_routing_predicted_hit_tokens_total")
    assert predicted[(urls[home],)] == 3 * 6 * BS and predicted[(urls[1 - home],)] == 0
    decisions = router_samples(aware.url, "pagedllm:router_routing_decisions_total")
    assert decisions[(urls[home], "prefix_match")] == 3
    relayed = router_samples(aware.url, "pagedllm:prefix_cache_hits_total")  # the replicas' own, per replica
    assert relayed == {(u,): counter(r, "prefix_cache_hits") for u, r in zip(urls, replicas)}

    # chat: the router renders the chat template as the replica does, so a long shared system prompt stays home too
    system = {"role": "system", "content": "You are a patient astronomy tutor who explains tides slowly. " * 6}
    queries0 = counters(replicas, "prefix_cache_queries")
    for k in range(3):
        assert chat(aware.url, [system, {"role": "user", "content": f"Question {k}: why {k} tides?"}], 2) \
            .status_code == 200
    queries = [q - q0 for q, q0 in zip(counters(replicas, "prefix_cache_queries"), queries0)]
    assert min(queries) == 0 and max(queries) > 0

    # least loaded: one request at a time, so ties, taken round robin: the same requests spread over both
    prefix = ids(101, 6 * BS)
    queries0, hits0 = counters(replicas, "prefix_cache_queries"), counters(replicas, "prefix_cache_hits")
    before = router_samples(loaded.url, "pagedllm:router_routing_decisions_total")
    for k in range(4):
        assert complete(loaded.url, prefix + ids(300 + k, 10), 2).status_code == 200
    queries = [q - q0 for q, q0 in zip(counters(replicas, "prefix_cache_queries"), queries0)]
    hits = [h - h0 for h, h0 in zip(counters(replicas, "prefix_cache_hits"), hits0)]
    after = router_samples(loaded.url, "pagedllm:router_routing_decisions_total")
    assert all(q > 0 for q in queries) and hits == [6 * BS, 6 * BS]  # each computed the prefix once
    assert [after[(u, "least_loaded")] - before[(u, "least_loaded")] for u in urls] == [2, 2]


def test_load_bound_sends_a_request_elsewhere_when_its_replica_is_flooded(replicas, routers):
    aware, _ = routers
    urls = [r.url for r in replicas]
    prefix = ids(500, 4 * BS)
    queries0 = counters(replicas, "prefix_cache_queries")
    assert complete(aware.url, prefix + ids(501, 8), 1).status_code == 200
    home = max(range(2), key=lambda i: counter(replicas[i], "prefix_cache_queries") - queries0[i])
    results: list = []
    long = [threading.Thread(target=lambda k=k: results.append(complete(aware.url, prefix + ids(510 + k, 8), 400)))
            for k in range(3)]
    for t in long:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while router_samples(aware.url, "pagedllm:router_requests_in_flight").get((urls[home],)) != 3:
            assert time.monotonic() < deadline, "the three long requests never ran at once on their prefix's replica"
            time.sleep(0.02)
        before = router_samples(aware.url, "pagedllm:router_routing_decisions_total")
        other0 = counter(replicas[1 - home], "prefix_cache_queries")
        # 3 in flight there, 0 here: above the bound (2 more, and more than 1.5 times): placed by load instead
        assert complete(aware.url, prefix + ids(520, 8), 1).status_code == 200
        after = router_samples(aware.url, "pagedllm:router_routing_decisions_total")
        assert after[(urls[1 - home], "load_bound")] - before[(urls[1 - home], "load_bound")] == 1
        assert counter(replicas[1 - home], "prefix_cache_queries") > other0
    finally:
        for t in long:
            t.join(120)
    assert [r.status_code for r in results] == [200] * 3
    assert router_samples(aware.url, "pagedllm:router_requests_in_flight") == {(u,): 0 for u in urls}


def test_a_killed_replica_is_routed_around_and_receives_again_after_restart(replicas, routers):
    down, up = replicas[1], replicas[0]
    down.kill()
    try:
        for router in routers:  # straight after the kill: a refused connection sends the request to the other
            r = complete(router.url, ids(600, 20), 2)
            assert r.status_code == 200, r.text
        health = httpx.get(f"{routers[0].url}/health", timeout=15)
        assert health.status_code == 200  # one replica is enough
        states = {b["url"]: b["healthy"] for b in health.json()["backends"]}
        assert states == {up.url: True, down.url: False}
        for router in routers:
            before = router_samples(router.url, "pagedllm:router_routing_decisions_total")
            for k in range(4):
                r = complete(router.url, ids(610 + k, 20), 2)
                assert r.status_code == 200, r.text
            after = router_samples(router.url, "pagedllm:router_routing_decisions_total")
            assert all(after[k] == v for k, v in before.items() if k[0] == down.url)  # nothing placed there
            assert router_samples(router.url, "pagedllm:router_backend_up") == {(up.url,): 1, (down.url,): 0}
    finally:
        down.start()
    for router in routers:
        deadline = time.monotonic() + 15
        while router_samples(router.url, "pagedllm:router_backend_up")[(down.url,)] != 1:
            assert time.monotonic() < deadline, "the restarted replica was not taken back"
            time.sleep(0.1)
    assert counter(down, "prompt_tokens") == 0  # a fresh process
    for k in range(4):  # least loaded, one at a time: round robin, so the restarted replica gets its share
        assert complete(routers[1].url, ids(620 + k, 20), 2).status_code == 200
    assert counter(down, "prompt_tokens") >= 2 * 20


def test_all_backends_down_is_a_503_in_the_openai_shape():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = ReplicaRouter(dead, "--connect-retries", "3", healthy=False)
    try:
        t0 = time.monotonic()
        r = complete(router.url, ids(700, 20), 2)
        assert r.status_code == 503 and time.monotonic() - t0 < 15
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and err["code"] == "backend_unavailable"
        assert "backend" in err["message"] and r.headers["retry-after"] == "1"
        health = httpx.get(f"{router.url}/health", timeout=15)
        assert health.status_code == 503 and health.json()["error"]["code"] == "backend_unavailable"
        assert [b["healthy"] for b in health.json()["backends"]] == [False, False]
    finally:
        router.stop()


def test_conflicting_flags_are_a_clear_error():
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "router", "--backend", "http://127.0.0.1:1",
                           "--prefill", "http://127.0.0.1:2"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--backend" in done.stderr and "not both" in done.stderr


def test_several_prefill_and_decode_instances(replicas):
    """P/D with two of each (here the two replicas in both roles: without a KV connector the decode leg computes the
    prompt itself): the prefill instance follows the prompt's prefix, the decode instance the load."""
    urls = [r.url for r in replicas]
    router = ReplicaRouter([], *[a for u in urls for a in ("--prefill", u)], *[a for u in urls for a in ("--decode", u)],
                           "--model", tiny_chat_model(), "--block-size", str(BS))
    try:
        prefix = ids(800, 4 * BS)
        for k in range(4):
            prompt = prefix + ids(801 + k, 8)
            r = complete(router.url, prompt, 6)
            assert r.status_code == 200, r.text
            alone = complete(urls[0], prompt, 6).json()["choices"][0]["token_ids"]
            assert r.json()["choices"][0]["token_ids"] == alone
        pre = router_samples(router.url, "pagedllm:router_routing_decisions_total", "prefill")
        dec = router_samples(router.url, "pagedllm:router_routing_decisions_total", "decode")
        assert sorted(pre[(u, "prefix_match")] for u in urls) == [0, 3]  # the first computed it, three followed
        assert [dec[(u, "least_loaded")] for u in urls] == [2, 2]  # one at a time: round robin
    finally:
        router.stop()
