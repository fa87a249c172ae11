"""Issue 31's fault list for prefill/decode disaggregation and the disk tier, as real processes on 127.0.0.1 (the
happy path and the damaged-transfer / stale-params / restart cases: test_pd_disagg.py). Each fault ends in a clear
error in the OpenAI shape or a recompute with the colocated engine's greedy output, within a bound, never a hang;
afterwards the surviving instances' /metrics show nothing held (requests, blocks, delayed frees) and nothing is
left in the transfer folder.

- the decode instance killed mid-stream: the client's stream ends with an SSE error event (the openai client raises
  it as ``APIError``);
- the decode instance killed with the transfer in it (the prefill instance wrote it, the decode instance has the
  request), then down: 503 naming it, the orphaned files expire;
- the prefill instance killed with the request in it (and the half-written files a writer killed mid-write
  leaves): 503 naming it, leftovers swept; both restarted where the router expects them, served again;
- a corrupted and a truncated disk-tier block under ``pagedllm serve --kv-offload-dir``: recomputed, same output;
- a full disk tier (a tmpfs too small for one block, ENOSPC), for the offload tier and for the prefill instance's
  transfer folder: the tier turns off with one warning, outputs unchanged.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
import torch
from pd_processes import AUTH, BS, FULL_FS, Instance, Router, loopback_config
from server_utils import API_KEY, metrics, tiny_chat_model, wait_idle

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

TTL_S = 3.0
BLOCK_BYTES = 2 * 2 * BS * 1 * 32 * 4  # the tiny chat model: layers x K/V x tokens x kv heads x head size x float32


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def files(store: str, pattern: str = "*.kvb") -> list[str]:
    return glob.glob(os.path.join(store, "*", "*", pattern))


def complete(url: str, prompt: list[int], n: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": "test-model", "prompt": prompt, "max_tokens": n, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True, **extra})


def assert_nothing_held(url: str) -> dict:
    """The instance's /metrics once idle: no request, no KV block, no block a connector still keeps."""
    m = wait_idle(url)
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0, m
    assert m["pagedllm:kv_cache_used_blocks"] == 0, m
    assert m.get("pagedllm:kv_offload_delayed_frees", 0) == 0, m
    return m


def wait_until(cond, timeout: float, poke=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if poke is not None:
            poke()
        time.sleep(0.3)
    return cond()


@pytest.fixture(scope="module")
def colocated():
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=512, block_size=BS)

    def run(prompt: list[int], n: int) -> list[int]:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    yield run
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("pd-faults-store"))
    started: dict[str, Instance] = {}
    errors: list[BaseException] = []

    def start(role: str) -> None:
        try:
            started[role] = Instance("--kv-transfer-config", loopback_config(role, store, TTL_S))
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other one is stopped
            errors.append(e)

    threads = [threading.Thread(target=start, args=(r,)) for r in ("kv_producer", "kv_consumer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router = None
    try:
        if errors:
            raise errors[0]
        p, d = started["kv_producer"], started["kv_consumer"]
        router = Router(p.url, d.url)
        yield p, d, router, store
    finally:
        if router is not None:
            router.stop()
        for b in started.values():
            b.stop()


def restart(b: Instance, router: Router) -> None:
    b.start()
    assert httpx.get(f"{router.url}/health", timeout=15).status_code == 200


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_event(pd, colocated):
    p, d, router, store = pd
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.completions.create(model="test-model", prompt=ids(1, 16), max_tokens=490, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    got = []
    t0 = None
    try:
        with pytest.raises(openai.APIError) as e:
            for chunk in stream:
                got.append(chunk.choices[0].text)
                if len(got) == 3:
                    d.kill()
                    t0 = time.monotonic()
        assert time.monotonic() - t0 < 15 and 3 <= len(got) < 490
        # the error event's body as the openai client read it: the OpenAI error shape, naming the decode instance
        assert "decode instance is unavailable" in str(e.value) and "mid-stream" in str(e.value)
        assert e.value.body["type"] == "service_unavailable_error" and e.value.body["code"] == "backend_unavailable"
        assert_nothing_held(p.url)
    finally:
        restart(d, router)
    assert_nothing_held(d.url)
    # the router serves again after the decode instance came back, with the colocated engine's tokens
    prompt = ids(2, 50)
    assert complete(router.url, prompt).json()["choices"][0]["token_ids"] == colocated(prompt, 8)
    assert files(store) == []


def test_decode_killed_mid_transfer_is_a_503_and_the_files_expire(pd, colocated):
    p, d, router, store = pd
    result: dict = {}
    os.kill(d.proc.pid, signal.SIGSTOP)  # frozen: P's leg completes, the decode leg waits in D unanswered
    try:
        def call():
            result["r"] = complete(router.url, ids(3, 100), 8)
            result["t"] = time.monotonic()
        t = threading.Thread(target=call)
        t.start()
        assert wait_until(lambda: len(files(store)) == (100 - 1) // BS, 30)  # P wrote the transfer's 6 blocks
        time.sleep(1.0)
        assert t.is_alive()  # the transfer is D's now, not yet loaded
        t0 = time.monotonic()
        d.kill()
        t.join(20)
        assert not t.is_alive() and result["t"] - t0 < 10
        for r in (result["r"], complete(router.url, ids(4, 100), 8)):  # killed in it; then down (refused)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            err = r.json()["error"]
            assert err["type"] == "service_unavailable_error" and err["code"] == "backend_unavailable"
            assert "decode instance is unavailable" in err["message"]
        assert len(files(store)) >= (100 - 1) // BS  # orphaned (the first may be expiring already: ttl_s is 3 s)
        m = assert_nothing_held(p.url)  # P freed its blocks when its legs finished
        assert m["pagedllm:kv_offload_load_errors_total"] == 0
    finally:
        restart(d, router)
    # never consumed: expired after ttl_s by whichever instance steps next
    assert wait_until(lambda: files(store) == [], 8 * TTL_S, poke=lambda: complete(p.url, ids(5, 4), 1))
    prompt = ids(6, 70)
    before = metrics(d.url)["pagedllm:kv_offload_hits_total"]
    assert complete(router.url, prompt).json()["choices"][0]["token_ids"] == colocated(prompt, 8)
    assert metrics(d.url)["pagedllm:kv_offload_hits_total"] - before == (70 - 1) // BS
    assert_nothing_held(d.url)
    assert_nothing_held(p.url)


def test_prefill_killed_with_the_request_in_it_is_a_503_and_leftovers_are_swept(pd, colocated):
    p, d, router, store = pd
    result: dict = {}
    os.kill(p.proc.pid, signal.SIGSTOP)  # frozen: the router's prefill leg is sent and waits for P's answer
    try:
        def call():
            result["r"] = complete(router.url, ids(7, 120), 8)
            result["t"] = time.monotonic()
        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.5)
        assert t.is_alive()  # in P, unanswered
        t0 = time.monotonic()
        p.kill()  # (SIGKILL ends a stopped process too)
        t.join(20)
        assert not t.is_alive() and result["t"] - t0 < 10
        r = result["r"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable_error" and "prefill instance is unavailable" in err["message"]
        h = httpx.get(f"{router.url}/health", timeout=15)
        assert h.status_code == 503 and "prefill" in h.json()["error"]["message"]
        assert_nothing_held(d.url)
        # what a producer killed while writing leaves: a half-written temporary file and part of a transfer
        # (the kill's timing cannot be chosen, so the leftovers are laid down as it leaves them)
        sub = os.path.join(glob.glob(os.path.join(store, "*"))[0], "ab")
        os.makedirs(sub, exist_ok=True)
        leftovers = [os.path.join(sub, ".0123456789abcdef.tmp"), os.path.join(sub, "ab" + "0" * 62 + ".kvb")]
        for f in leftovers:
            with open(f, "wb") as fh:
                fh.write(b"PKVB1\n" + os.urandom(100))
    finally:
        restart(p, router)
    assert wait_until(lambda: not any(map(os.path.exists, leftovers)), 8 * TTL_S,
                      poke=lambda: complete(d.url, ids(8, 4), 1))
    prompt = ids(9, 90)
    assert complete(router.url, prompt).json()["choices"][0]["token_ids"] == colocated(prompt, 8)
    assert_nothing_held(p.url)
    assert_nothing_held(d.url)
    assert files(store) == [] and files(store, ".*.tmp") == []


def _served_disk_tier(folder: str, wrap=()) -> Instance:
    """A 16-block device pool over a disk tier (no host tier): a 160-token prefix is evicted by a 200-token one."""
    return Instance("--max-model-len", "256", "--kv-cache-memory", str(16 * BLOCK_BYTES), "--kv-offload-dir", folder,
                    "--kv-offload-disk-gib", "1", wrap=wrap)


def _evict_prefix(url: str, prefix: list[int], filler: list[int]) -> None:
    for prompt in (prefix + ids(19, 3), filler):
        assert complete(url, prompt, 4).status_code == 200


def test_corrupted_and_truncated_disk_tier_blocks_are_recomputed(tmp_path, colocated):
    prefix, filler = ids(10, 160), ids(11, 200)
    server = _served_disk_tier(str(tmp_path))
    try:
        _evict_prefix(server.url, prefix, filler)
        stored = sorted(files(str(tmp_path)), key=os.path.getmtime)
        assert len(stored) >= 6, stored  # the prefix's evicted blocks
        for i, f in enumerate(stored):  # every stored block damaged: the first one read fails, whichever it is
            with open(f, "r+b") as fh:
                if i % 2:
                    fh.truncate(os.path.getsize(f) - 100)
                else:
                    fh.seek(-50, os.SEEK_END)
                    b = fh.read(1)
                    fh.seek(-50, os.SEEK_END)
                    fh.write(bytes([b[0] ^ 0xFF]))
        m0 = metrics(server.url)
        query = prefix + ids(12, 7)
        r = complete(server.url, query, 6)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated(query, 6)
        m = assert_nothing_held(server.url)
        assert m["pagedllm:kv_offload_recomputes_total"] - m0["pagedllm:kv_offload_recomputes_total"] == 1
        assert m["pagedllm:kv_offload_load_errors_total"] > m0["pagedllm:kv_offload_load_errors_total"]
        assert len([f for f in stored if not os.path.exists(f)]) >= 1  # the bad file it read was deleted
        assert "KV offload: dropping" in server.output()
    finally:
        server.stop()


def _unshare_works() -> str:
    done = subprocess.run([*FULL_FS, "/tmp", "4k", "true"], capture_output=True, text=True, timeout=30)
    return "" if done.returncode == 0 else done.stderr


def test_a_full_disk_tier_turns_off_with_one_warning_and_outputs_are_unchanged(tmp_path, colocated):
    why = _unshare_works()
    assert not why, f"a full file system needs a private mount namespace (`unshare -rm`): {why}"
    prefix, filler = ids(13, 160), ids(14, 200)
    full = str(tmp_path / "full")
    os.makedirs(full)
    server = _served_disk_tier(full, wrap=[*FULL_FS, full, "4k"])  # a 4 KiB tmpfs: no block file fits
    try:
        _evict_prefix(server.url, prefix, filler)
        query = prefix + ids(15, 7)
        r = complete(server.url, query, 6)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated(query, 6)
        m = assert_nothing_held(server.url)
        assert m["pagedllm:kv_offload_hits_total"] == 0 and m["pagedllm:kv_offload_load_errors_total"] == 0
        log = server.output()
        assert log.count("KV offload disk tier off") == 1 and "ENOSPC" in log, log
    finally:
        server.stop()


def test_a_full_transfer_folder_on_the_prefill_instance_is_a_recompute_on_decode(tmp_path, colocated):
    why = _unshare_works()
    assert not why, f"a full file system needs a private mount namespace (`unshare -rm`): {why}"
    store = str(tmp_path / "store")
    os.makedirs(store)
    p = Instance("--kv-transfer-config", loopback_config("kv_producer", store, TTL_S), wrap=[*FULL_FS, store, "4k"])
    d = router = None
    try:
        d = Instance("--kv-transfer-config", loopback_config("kv_consumer", store, TTL_S))
        router = Router(p.url, d.url)
        for seed in (16, 17):  # the first write fails (ENOSPC, the tier turns off); the next request writes nothing
            prompt = ids(seed, 100)
            r = complete(router.url, prompt)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated(prompt, 8)
        md = assert_nothing_held(d.url)
        assert md["pagedllm:kv_offload_hits_total"] == 0 and md["pagedllm:kv_offload_load_errors_total"] == 0
        assert_nothing_held(p.url)
        assert "ENOSPC" in p.output()
    finally:
        for x in (router, d, p):
            if x is not None:
                x.stop()
    shutil.rmtree(store, ignore_errors=True)
