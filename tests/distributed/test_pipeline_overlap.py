"""Pipeline parallel with batches in flight across engine steps (vLLM's batch queue): with PP=2 the engine keeps two
steps of disjoint requests in flight, so stage 1 runs one while rank 0 runs its stage of the next. Checked from the
executor's own counters and the batches the engine really submitted (not from timing), against the one-rank
engine's greedy tokens; abort and a killed stage still behave."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dist_utils import engine, make_dist_model, workload
from pagedllm import SamplingParams
from pagedllm.executor import WorkerDiedError
from pagedllm.executor import base as executor_base

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_dist_model("llama", tmp_path_factory.mktemp("pp_overlap"))
    prompts = workload(seed=11, num=16)  # more requests than one batch: max_num_seqs=8, 48-token budget
    want = tokens_of(engine(path), prompts)
    threads = torch.get_num_threads()
    llm = engine(path, pp=2)
    yield path, prompts, want, llm
    llm.llm_engine.shutdown()
    torch.set_num_threads(threads)  # later tests in this process compare against in-process arithmetic


def tokens_of(llm, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def reset_counters(ex) -> None:
    ex.num_in_flight = ex.max_in_flight = ex.num_overlapped_submits = ex.num_steps = 0


def test_two_batches_of_disjoint_requests_in_flight(setup):
    _, prompts, want, llm = setup
    eng, ex = llm.llm_engine, llm.llm_engine.executor
    assert ex.max_concurrent_batches == 2
    reset_counters(ex)
    worker = eng.worker
    submit, finish = worker.submit_model, worker.finish_model
    in_flight: dict[int, set[str]] = {}  # id(pending) -> its requests
    overlapped, clashes, sizes = 0, [], []

    def recording_submit(scheduled):
        nonlocal overlapped
        ids = {s.request.request_id for s in scheduled}
        busy = set().union(*in_flight.values())
        clashes.extend(ids & busy)  # a request must never be in two batches in flight
        overlapped += bool(in_flight)
        sizes.append(len(ids))
        pending = submit(scheduled)
        in_flight[id(pending)] = ids
        return pending

    def recording_finish(pending, grammar=None):
        out = finish(pending, grammar)
        in_flight.pop(id(pending))
        return out

    worker.submit_model, worker.finish_model = recording_submit, recording_finish
    try:
        got = tokens_of(llm, prompts)
    finally:
        del worker.submit_model, worker.finish_model
    assert got == want
    assert clashes == []
    assert ex.max_in_flight == 2 and ex.num_in_flight == 0 and not in_flight
    assert ex.num_overlapped_submits == overlapped >= ex.num_steps // 2
    assert ex.num_steps == len(sizes) >= 10
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.in_flight and not eng.batch_queue
    print(f"{ex.num_steps} steps, {overlapped} submitted with another in flight, batch sizes {sizes}")


def test_one_batch_at_a_time_cuts_micro_batches(setup, monkeypatch):
    """``max_concurrent_batches = 1`` (the batch queue off: the behaviour before it, kept for comparison) runs each
    step alone, cut into two micro-batches; same tokens."""
    _, prompts, want, llm = setup
    ex = llm.llm_engine.executor
    splits: list[int] = []
    split = executor_base.split_micro_batches

    def counting_split(*args):
        mbs, order = split(*args)
        splits.append(len(mbs))
        return mbs, order

    monkeypatch.setattr(executor_base, "split_micro_batches", counting_split)
    monkeypatch.setattr(ex, "max_concurrent_batches", 1)
    reset_counters(ex)
    assert tokens_of(llm, prompts) == want
    assert ex.max_in_flight == 1 and ex.num_overlapped_submits == 0
    assert max(splits) == 2 and len(splits) == ex.num_steps


def test_abort_while_in_flight_frees_blocks_and_keeps_the_pipeline_in_step(setup):
    _, prompts, want, llm = setup
    eng = llm.llm_engine
    rids = [eng.add_request(f"ab{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(prompts[:6])]
    for _ in range(3):
        eng.step()
    assert eng.batch_queue and eng.scheduler.in_flight
    victim = sorted(eng.scheduler.in_flight)[0]  # its batch is still on the way through stage 1
    eng.abort_request(victim)
    done, late = {}, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            late += [out.request_id] if out.request_id == victim else []
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert late == [] and victim not in done
    assert done == {rid: want[i] for i, rid in enumerate(rids) if rid != victim}
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.in_flight and not eng.batch_queue
    # Abort everything while batches are in flight: the queue drains (their logits are taken off the wire), and the
    # next request gets its own logits, not a stale batch's.
    for i, p in enumerate(prompts[6:10]):
        eng.add_request(f"all{i}", {"prompt_token_ids": p}, GREEDY)
    eng.step(), eng.step()
    assert eng.batch_queue
    eng.abort_request([f"all{i}" for i in range(4)])
    assert eng.has_unfinished_requests()  # (the queue still holds batches)
    while eng.has_unfinished_requests():
        assert eng.step() == []
    assert eng.kv.num_used_blocks == 0
    assert tokens_of(llm, prompts[10:12]) == want[10:12]


@pytest.mark.timeout(180)
def test_killed_stage_fails_the_step_instead_of_hanging(setup):
    """(Last: it kills the module's engine; one process holds one torch.distributed world at a time.)"""
    _, prompts, _, llm = setup
    eng = llm.llm_engine
    pid = eng.executor.worker_pids[0]  # stage 1
    try:
        for i, p in enumerate(prompts[:8]):
            eng.add_request(f"k{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(4):
            eng.step()
        assert eng.batch_queue
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            for _ in range(100):
                eng.step()
        took = time.monotonic() - t0
        print(f"killed stage detected after {took:.2f}s")
        assert took < 30  # the closed connection, not the collective timeout
        eng.abort_request([f"k{i}" for i in range(8)])
        assert eng.kv.num_used_blocks == 0
    finally:
        eng.shutdown()
