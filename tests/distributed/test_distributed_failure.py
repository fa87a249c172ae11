"""A rank dying mid-generation: the engine reports it, in-flight requests get an error, the server answers 503 on
/health, and nothing hangs (hard pytest timeout; the collective wait has its own timeout as the backstop)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from server_utils import ServerProcess, cmdline, descendants, tiny_chat_model


def _rank_pids(srv: ServerProcess) -> list[int]:
    return [p for p in descendants(srv.proc.pid) if "pagedllm.executor" in cmdline(p)]


@pytest.mark.timeout(240)
def test_killed_rank_fails_requests_and_serves_503():
    srv = ServerProcess(tiny_chat_model(), "--tensor-parallel-size", "2", "--max-model-len", "512",
                        "--no-exit-on-engine-failure", api_key=None)
    try:
        ranks = _rank_pids(srv)
        assert len(ranks) == 1, [cmdline(p) for p in descendants(srv.proc.pid)]
        started, results = threading.Barrier(5), []

        def stream() -> None:
            body = {"model": "test-model", "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                    "ignore_eos": True}
            chunks, error = 0, None
            with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.url_v1}/completions", json=body) as r:
                try:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"error"' not in line:
                            chunks += 1
                            if chunks == 1:
                                started.wait(60)
                        elif '"error"' in line:
                            error = line
                except httpx.HTTPError as e:
                    error = repr(e)
            results.append((chunks, error, time.monotonic()))

        threads = [threading.Thread(target=stream, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(60)
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        assert len(results) == 4
        for chunks, error, end in results:
            assert error is not None and chunks < 400, (chunks, error)  # cut short with an error, not finished
        took = max(end for _, _, end in results) - killed
        print(f"in-flight streams failed {took:.2f}s after the rank was killed: {results[0][1][:200]}")
        assert took < 30
        h = httpx.get(f"{srv.base_url}/health", timeout=10)
        assert h.status_code == 503 and "rank 1" in h.text, h.text
        r = httpx.post(f"{srv.url_v1}/completions", json={"model": "test-model", "prompt": "x", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"]
        assert srv.proc.poll() is None  # the server itself lives on (--no-exit-on-engine-failure)
    finally:
        srv.stop()


@pytest.mark.timeout(120)
def test_hung_rank_times_out_instead_of_hanging(tmp_path):
    """A rank that stops answering (SIGSTOP) fails the step after ``distributed_timeout_s``, naming the step."""
    from dist_utils import engine, make_dist_model
    from pagedllm import SamplingParams
    from pagedllm.executor import WorkerDiedError

    llm = engine(make_dist_model("llama", tmp_path), tp=2, distributed_timeout_s=5.0)
    pid = llm.llm_engine.executor.worker_pids[0]
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="distributed step failed"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
        took = time.monotonic() - t0
        print(f"hung rank detected after {took:.1f}s")
        assert 4.5 < took < 30
    finally:
        os.kill(pid, signal.SIGKILL)
        llm.llm_engine.shutdown()
