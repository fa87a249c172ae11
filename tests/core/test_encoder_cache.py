"""The encoder cache's accounting (vLLM's ``EncoderCacheManager``), the scheduler's encoder budget, and image hashes
in prefix-cache block hashes, on real requests through the real scheduler and KV manager (no model: the model-level
oracle is tests/models/test_llava.py)."""

from __future__ import annotations

from pagedllm.multimodal.encoder_cache import EncoderCacheManager, free_computed_inputs, schedule_encoder_inputs
from pagedllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, mm_hashes_in
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request, RequestStatus
from pagedllm.sched.scheduler import Scheduler, SchedulerOutput

IMG = 9  # the image placeholder token


def request(rid: str, layout: list, arrival: float = 0.0) -> Request:
    """A request whose prompt is ``layout``: ints are text tokens, ``(hash, n)`` an image of ``n`` placeholders."""
    ids: list[int] = []
    feats = []
    for part in layout:
        if isinstance(part, tuple):
            h, n = part
            feats.append(MultiModalFeatureSpec({}, "image", h, PlaceholderRange(len(ids), n)))
            ids.extend([IMG] * n)
        else:
            ids.append(part)
    req = Request(rid, ids, SamplingParams(max_tokens=4), arrival_time=arrival)
    req.mm_features = feats
    return req


def test_manager_references_eviction_order_and_freed_hashes():
    m = EncoderCacheManager(cache_size=10)
    a, b, c = request("a", [1, ("A", 4)]), request("b", [1, ("B", 4)]), request("c", [("C", 6)])
    assert not m.check_and_update_cache(a, 0)
    assert m.can_allocate(a, 0, encoder_compute_budget=10, num_tokens_to_schedule=0)
    m.allocate(a, 0)
    m.allocate(b, 0)
    assert m.num_free_slots == 2 and m.num_referenced_tokens == 8
    # C (6) does not fit: A and B are referenced, nothing may be evicted
    assert not m.can_allocate(c, 0, 10, 0)
    # A second request with A's pixels shares the entry
    a2 = request("a2", [2, 2, ("A", 4)])
    assert m.check_and_update_cache(a2, 0)
    m.free(a)
    assert m.num_referenced_tokens == 8  # a2 still holds A
    m.free(a2)
    m.free_encoder_input(b, 0)
    assert m.num_referenced_tokens == 0 and list(m.freeable) == ["A", "B"]  # least recently freed first
    # a freeable entry is still a hit (and referenced again) until evicted
    assert m.check_and_update_cache(b, 0) and list(m.freeable) == ["A"]
    m.free(b)
    # C needs 6: A (freed first) is evicted, B stays
    assert m.can_allocate(c, 0, 10, 0)
    m.allocate(c, 0)
    assert m.get_freed_mm_hashes() == ["A"] and m.get_freed_mm_hashes() == []
    assert set(m.cached) == {"B", "C"} and m.num_free_slots == 0
    # the per-step compute budget bounds what is encoded, whatever space is free
    assert not m.can_allocate(a, 0, encoder_compute_budget=3, num_tokens_to_schedule=0)


def test_schedule_encoder_inputs_cuts_before_an_image_that_does_not_fit():
    m = EncoderCacheManager(cache_size=8)
    req = request("r", [1, 2, 3, ("X", 5), 4, 5, ("Y", 5), 6])  # X at 3..7, Y at 10..14
    # a chunk before the first image encodes nothing
    assert schedule_encoder_inputs(req, 0, 3, m, 8) == ([], 3, 8)
    # a chunk into X encodes X (budget 8 - 5); Y is not reached
    enc, n, left = schedule_encoder_inputs(req, 0, 6, m, 8)
    assert (enc, n, left) == ([0], 6, 3)
    m.allocate(req, 0)
    # continuing inside X: X is cached; reaching Y with budget 3 < 5: the chunk stops right before Y
    enc, n, left = schedule_encoder_inputs(req, 6, 9, m, 3)
    assert (enc, n, left) == ([], 4, 3)
    # once X is computed its reference goes; Y then fits (X is evicted for it)
    req.num_computed_tokens = 10
    free_computed_inputs(req, m)
    assert m.num_referenced_tokens == 0
    enc, n, left = schedule_encoder_inputs(req, 10, 5, m, 8)
    assert (enc, n) == ([1], 5)
    m.allocate(req, 1)
    assert m.get_freed_mm_hashes() == ["X"]
    # a request starting inside an image (a prefix-cache hit ending mid-image) still needs that image
    other = request("o", [1, 2, 3, ("X", 5), 7])
    assert schedule_encoder_inputs(other, 5, 4, EncoderCacheManager(8), 8)[0] == [0]
    # an image already computed (or served from the prefix cache) needs no encoding
    assert schedule_encoder_inputs(other, 8, 1, EncoderCacheManager(8), 8)[0] == []


def test_the_same_image_twice_in_a_prompt_is_encoded_once_and_held_until_its_last_use():
    m = EncoderCacheManager(cache_size=8)
    req = request("r", [1, ("S", 4), 2, ("S", 4), 3])  # S at 1..4 and 6..9
    enc, n, _ = schedule_encoder_inputs(req, 0, 11, m, 8)
    assert enc == [0] and n == 11
    m.allocate(req, 0)
    req.num_computed_tokens = 5  # the first occurrence computed, the second not
    free_computed_inputs(req, m)
    assert m.num_referenced_tokens == 4
    req.num_computed_tokens = 10
    free_computed_inputs(req, m)
    assert m.num_referenced_tokens == 0


def scheduler(budget_tokens: int, encoder_tokens: int, num_blocks: int = 32) -> Scheduler:
    s = Scheduler(KVCacheManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=budget_tokens,
                  max_model_len=64)
    s.encoder_cache = EncoderCacheManager(encoder_tokens)
    s.max_num_encoder_input_tokens = encoder_tokens
    return s


def run_step(s: Scheduler):
    out = s.schedule()
    s.update(out)
    return {x.request.request_id: (x.num_new_tokens, x.encoder_inputs) for x in out.scheduled}


def test_scheduler_budgets_encoder_compute_per_step_and_frees_on_finish_and_preemption():
    s = scheduler(budget_tokens=64, encoder_tokens=6)
    a = request("a", [1, 2, ("A", 6), 3], arrival=0)
    b = request("b", [4, ("B", 6), 5, 6], arrival=1)
    s.add_request(a)
    s.add_request(b)
    # one image of encoder work per step: a encodes A; b runs only its text before B
    assert run_step(s) == {"a": (9, [0]), "b": (1, [])}
    assert s.encoder_cache.num_referenced_tokens == 0  # A's tokens are all computed: freeable
    # next step: B fits after evicting A (a decodes meanwhile)
    a.append_token(7)
    assert run_step(s) == {"a": (1, []), "b": (8, [0])}
    assert s.encoder_cache.get_freed_mm_hashes() == ["A"]
    # a preempted request drops its references; a finished one too
    c = request("c", [1, ("C", 6), 2])
    s.add_request(c)
    s.max_num_batched_tokens = 4  # c stops inside its image
    b.append_token(7)
    a.append_token(7)
    step = run_step(s)
    assert step["c"] == (2, [0]) and s.encoder_cache.num_referenced_tokens == 6
    s._preempt(c, SchedulerOutput())
    assert s.encoder_cache.num_referenced_tokens == 0 and c.num_computed_tokens == 0
    for r in (a, b, c):
        s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_used_blocks == 0 and s.encoder_cache.num_referenced_tokens == 0


def test_block_hashes_carry_the_image_hashes_of_the_blocks_they_cover():
    kv = KVCacheManager(16, 4)
    x = request("x", [1, 2, 3, 4, 5, 6, ("P", 5), 7, 8, 9, 10])  # P at 6..10: blocks 1 and 2
    y = request("y", [1, 2, 3, 4, 5, 6, ("Q", 5), 7, 8, 9, 10])  # same tokens, other pixels
    z = request("z", [1, 2, 3, 4, 5, 6, ("P", 5), 7, 8, 9, 10])  # same pixels
    hx, hy, hz = (kv._block_hashes(r, 16) for r in (x, y, z))
    assert hx[0] == hy[0]  # before the image: shared
    assert hx[1] != hy[1] and hx[2] != hy[2] and hx[3] != hy[3]  # the image's blocks, and everything chained after
    assert hx == hz
    assert mm_hashes_in(x.mm_features, 4, 8) == ("P",) and mm_hashes_in(x.mm_features, 0, 4) == ()
    # a text-only request hashes as before (no extra key)
    t = Request("t", x.prompt_token_ids, SamplingParams())
    assert kv._block_hashes(t, 16)[1] != hx[1] and kv._block_hashes(t, 16)[0] == hx[0]
