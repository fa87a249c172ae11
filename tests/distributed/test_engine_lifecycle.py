"""Engine lifecycle (issue 33): engines of every parallel shape, one after another in one process, each shut down
(``shutdown()``, ``with``, dropped and garbage collected) leave no child process, thread, shared memory, socket or
descriptor behind (``process_census``), and give the same greedy tokens; so does the OpenAI server's engine
restarted in the process; a worker whose parent dies exits on its own even when its pipe never reaches EOF.

Oracle: the one-rank in-process engine's greedy tokens (TP / PP / DP differ from it only in float32 summation
order, which these few tokens of a tiny model do not reach; tests/distributed/test_distributed_tp.py bounds it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import openai
import psutil
import pytest
import uvicorn

import process_census as census
from dist_utils import engine, make_dist_model
from server_utils import free_port
from pagedllm import SamplingParams
from pagedllm.config import EngineConfig

PROMPTS = [[5, 6, 7, 8], list(range(3, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_dist_model("llama", tmp_path_factory.mktemp("lifecycle"))
    with engine(path) as one:  # the in-process engine: the oracle, and its shutdown the first lifecycle
        want = offline_tokens(one)
    return path, want


def offline_tokens(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_config(path: str, **kw) -> EngineConfig:
    """``dist_utils.engine``'s settings, for the server's engines."""
    return EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=128,
                        max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True,
                        skip_tokenizer_init=True, **kw)


def dp_tokens(path: str) -> list[list[int]]:
    """Data parallel (two engine processes, the server's DataParallelEngine), driven and shut down here."""
    from pagedllm.engine.dp_client import DataParallelEngine

    async def run() -> list[list[int]]:
        dp = DataParallelEngine(engine_config(path), [None, None])
        try:
            await dp.start()
            streams = [await dp.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(PROMPTS)]
            assert {s.engine.index for s in streams} == {0, 1}  # one prompt on each replica
            outs = []
            for s in streams:
                async for o in s:
                    last = o
                outs.append(list(last.outputs[0].token_ids))
            return outs
        finally:
            dp.shutdown()
            await asyncio.sleep(0.1)  # the pipes close on the loop (``AsyncEngine.shutdown``)
    return asyncio.run(run())


class Ledger:
    """The census before the first engine; ``check`` after each shutdown. Two things are opened once per process
    for good, by Python and torch rather than an engine, and join the baseline when they first appear: the pipe
    pair torch.distributed (c10d) opens on first use, and multiprocessing's resource tracker process (one pipe)."""

    def __init__(self):
        self.base = census.take()
        self.c10d = False

    def check(self, what: str, rebase_counts: bool = False) -> None:
        """``rebase_counts``: check what can be named (processes, Python threads, shared memory, sockets), then take
        this census's thread and descriptor counts as the baseline (a library's once-per-process state)."""
        after = census.take()
        tracker = {c for c in after.children - self.base.children if "multiprocessing.resource_tracker" in c}
        if tracker:
            self.base = dataclasses.replace(self.base, children=self.base.children | tracker, fds=self.base.fds + 1)
        if not self.c10d and after.fds >= self.base.fds + 2:
            self.base = dataclasses.replace(self.base, fds=self.base.fds + 2)
            self.c10d = True
        if rebase_counts:
            self.base = dataclasses.replace(self.base, os_threads=after.os_threads, fds=after.fds,
                                            fd_targets=after.fd_targets)
        assert census.leaks(self.base, after) == [], f"{what} left: {census.leaks(self.base, after)}"


def gone(pids: list[int]) -> bool:
    """No process left (a zombie orphan waiting for init to reap it has exited too)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_pp_dp_tp_one_after_another_release_everything(model):
    from pagedllm.engine.llm_engine import EngineClosedError

    path, want = model
    ledger = Ledger()
    t0 = time.monotonic()

    llm = engine(path, tp=2)  # TP=2, shut down explicitly (twice: idempotent)
    pids = llm.llm_engine.executor.worker_pids
    assert offline_tokens(llm) == want
    with pytest.raises(RuntimeError, match="another distributed engine is still running"):
        engine(path, pp=2)  # refused before it starts anything, naming the way out
    llm.shutdown()
    llm.shutdown()
    assert gone(pids)
    ledger.check("TP=2 after shutdown()")
    with pytest.raises(EngineClosedError):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)

    with engine(path, pp=2) as llm:  # PP=2 in a with block
        pids = llm.llm_engine.executor.worker_pids
        assert offline_tokens(llm) == want
    assert gone(pids)
    ledger.check("PP=2 after its with block")

    assert dp_tokens(path) == want  # DP=2: two engine processes
    ledger.check("DP=2 after shutdown()")

    llm = engine(path, tp=2)  # TP=2 again, dropped without shutdown: its finalizer releases it
    pids = llm.llm_engine.executor.worker_pids
    assert offline_tokens(llm) == want
    del llm
    assert gone(pids)
    ledger.check("TP=2 dropped")
    took = time.monotonic() - t0
    print(f"TP=2 -> PP=2 -> DP=2 -> TP=2, each generating and shut down: {took:.1f}s")
    assert took < 60


def serve_once(make_engine, port: int) -> tuple[list[list[int]], object]:
    """The OpenAI app around a new engine on a real uvicorn server in this process: greedy completions through the
    ``openai`` client, then the server stops (its lifespan shuts the engine down). Returns the tokens and the
    engine."""
    from pagedllm.entrypoints.openai.api_server import build_app

    engine_obj = make_engine()
    try:
        app = build_app(engine_obj, ["m"], api_key=None, cors={"allowed_origins": None})
    except BaseException:
        engine_obj.shutdown()
        raise
    # The asyncio loop: uvloop's libuv keeps a pool of 4 threads for the rest of the process once used
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=server.run, name="uvicorn")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                           timeout=60) as client:
            r = client.completions.create(model="m", prompt=PROMPTS, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        return [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)], engine_obj
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_engine_restarted_in_process(model):
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.dp_client import DataParallelEngine

    path, want = model
    ledger = Ledger()
    t0 = time.monotonic()
    for what, make in (("TP=2", lambda: AsyncEngine(engine_config(path, tensor_parallel_size=2))),
                       ("PP=2", lambda: AsyncEngine(engine_config(path, pipeline_parallel_size=2))),
                       ("DP=2", lambda: DataParallelEngine(engine_config(path), [None, None])),
                       ("TP=2 again", lambda: AsyncEngine(engine_config(path, tensor_parallel_size=2)))):
        tokens, stopped = serve_once(make, free_port())
        assert tokens == want, what
        assert not stopped.is_running
        ledger.check(f"the server's {what} engine")
    print(f"the server's engine restarted 4 times in one process: {time.monotonic() - t0:.1f}s")


ORPHAN = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, {support!r})
    from dist_utils import engine
    made = []
    if {in_thread!r}:  # started from a thread that then ends: the kernel's parent-death signal must not be armed
        t = threading.Thread(target=lambda: made.append(engine({path!r}, tp=2)))
        t.start()
        t.join()
        time.sleep(1.0)
    else:
        made.append(engine({path!r}, tp=2))
    llm = made[0]
    if os.fork() == 0:  # a child holding every descriptor, the driver's pipe ends included: no EOF will come
        time.sleep(120)
        os._exit(0)
    print(*llm.llm_engine.executor.worker_pids, flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "from-a-thread"])
def test_worker_exits_when_its_parent_is_killed(model, in_thread):
    """SIGKILL leaves no finalizer to run, and a forked sibling keeps the worker's pipe open: the worker must notice
    its parent's death itself — by the parent-death signal (engine started from the main thread) or its parent watch
    (started from another thread, which ended: the worker outlived that thread first)."""
    path, _ = model
    support = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN.format(support=support, path=path, in_thread=in_thread)],
                              stdout=subprocess.PIPE, text=True)
    sibling: list[int] = []
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 1, "the TP=2 engine did not start"
        assert not gone(workers)
        sibling = [c.pid for c in psutil.Process(parent.pid).children() if c.pid not in workers]
        assert len(sibling) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        t0 = time.monotonic()
        while not gone(workers) and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"the orphaned worker exited {took:.2f}s after its parent was killed")
        assert gone(workers), "the worker outlived its parent"
        assert psutil.pid_exists(sibling[0])  # its pipe end was still open: EOF did not do it
    finally:
        for pid in sibling:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if parent.poll() is None:
            parent.kill()
            parent.wait()


AT_EXIT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {support!r})
    from dist_utils import engine
    from pagedllm import SamplingParams
    llm = engine({path!r}, tp=2)
    llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=2), use_tqdm=False)
    print(*llm.llm_engine.executor.worker_pids, flush=True)
""")  # ends with the engine still referenced: only the interpreter's exit releases it


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_interpreter_exit_stops_an_engine_left_running(model):
    path, _ = model
    support = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    proc = subprocess.run([sys.executable, "-c", AT_EXIT.format(support=support, path=path)], capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = [int(p) for p in proc.stdout.split()]
    assert len(workers) == 1 and gone(workers)  # stopped and reaped before the interpreter was gone
    assert "Traceback" not in proc.stderr and "did not stop" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_engine_stops_the_ray_it_started(model, monkeypatch):
    """The Ray executor with no RAY_ADDRESS starts a local Ray; its shutdown stops it: no Ray process, Python thread,
    shared memory or TCP socket is left. Thread and descriptor counts are not asserted here: Ray's core-worker
    library keeps native threads and descriptors in the process after ``ray.shutdown()`` (Ray 2.60: its event
    loops, and each ``ray.init``'s driver log file and two Unix sockets), which no engine can close."""
    ray = pytest.importorskip("ray")  # an optional extra: pagedllm[ray]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    path, want = model
    ledger = Ledger()
    for shape in (dict(tp=2), dict(pp=2)):
        with engine(path, distributed_executor_backend="ray", **shape) as llm:
            assert llm.llm_engine.executor.name == "ray" and ray.is_initialized()
            assert offline_tokens(llm) == want
        assert not ray.is_initialized()
        ledger.check(f"{shape} on a local Ray", rebase_counts=True)
