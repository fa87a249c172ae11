"""Scheduler policy without a model: budgets, chunked prefill, preemption, FCFS/priority order."""

from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.scheduler import Scheduler


def make(num_blocks=64, bs=4, seqs=8, budget=32, policy="fcfs", caching=False):
    return Scheduler(KVCacheManager(num_blocks, bs, caching), seqs, budget, 1024, policy)


def fake_step(s: Scheduler, out):
    """What the engine does after the model runs: advance, and append a token for sampling rows."""
    samplers = [x.request for x in out.scheduled if x.samples]
    s.update(out)
    for r in samplers:
        r.append_token(5)


def test_chunked_prefill_splits_long_prompt_and_keeps_decodes_running():
    s = make(budget=16)
    short = Request("short", list(range(4)), SamplingParams())
    s.add_request(short)
    fake_step(s, s.schedule())  # short prefilled in one go
    long = Request("long", list(range(40)), SamplingParams())
    s.add_request(long)
    out = s.schedule()
    got = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    assert got == {"short": 1, "long": 15}  # decode first, prefill chunk fills the rest of the budget
    assert not [x for x in out.scheduled if x.request is long][0].samples
    fake_step(s, out)
    out = s.schedule()
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "long": 15}
    fake_step(s, out)
    out = s.schedule()
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "long": 10}
    assert [x for x in out.scheduled if x.request is long][0].samples


def test_max_num_seqs_caps_running():
    s = make(seqs=2)
    for i in range(4):
        s.add_request(Request(str(i), [1, 2], SamplingParams()))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_frees_blocks_and_requeues_latest_first():
    s = make(num_blocks=4, bs=4, budget=64)
    a = Request("a", list(range(7)), SamplingParams())
    b = Request("b", list(range(7)), SamplingParams())
    s.add_request(a)
    s.add_request(b)
    fake_step(s, s.schedule())  # each holds 2 blocks (8 slots): 7 computed, 8 tokens
    fake_step(s, s.schedule())  # 8 computed, 9 tokens
    fake_step(s, s.schedule())  # position 8 needs a third block for a -> b (latest) preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1
    assert s.kv.num_free_blocks == 1  # a holds 3
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert s.kv.num_free_blocks == 4
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [b] and out.scheduled[0].num_new_tokens == b.num_tokens


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    s = make(num_blocks=4, bs=4, budget=64, policy="priority")
    low = Request("low", list(range(7)), SamplingParams(priority=5))
    high = Request("high", list(range(7)), SamplingParams(priority=0))
    s.add_request(low)
    s.add_request(high)
    assert s.waiting[0] is high
    for _ in range(3):
        fake_step(s, s.schedule())
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING


def _children(parent: str, n: int, prompt_len: int = 3) -> list[Request]:
    return [Request(f"{i}_{parent}", list(range(prompt_len)), SamplingParams(), parent_id=parent) for i in range(n)]


def test_a_large_n_request_takes_a_capped_rotating_share_while_others_run():
    """Issue 34: n=128 with logprobs made every step ~100 ms for everyone. While another client's request is
    active, one request's samples take at most 16 rows of a step, in turn; alone, they take every row."""
    s = make(num_blocks=512, seqs=256, budget=512)
    kids = _children("big", 40)
    for r in kids:
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled) == 40  # alone: every sample in one step
    fake_step(s, out)
    small = Request("small", [1, 2, 3], SamplingParams())
    s.add_request(small)
    seen: list[set[str]] = []
    for _ in range(3):
        out = s.schedule()
        ids = {x.request.request_id for x in out.scheduled}
        assert "small" in ids and len(ids - {"small"}) == s.max_rows_per_request
        seen.append(ids - {"small"})
        fake_step(s, out)
    assert not (seen[0] & seen[1]) and len(seen[0] | seen[1] | seen[2]) == 40  # rotates over all 40 samples
    s.finish(small, RequestStatus.FINISHED_STOPPED)
    assert len(s.schedule().scheduled) == 40  # alone again: all of them
